"""Compile one parameter's recorded writes into a flat copy program: batched strided copies and fills.

A `ParamPlan` lists every write SGLang's loader made into the parameter (`plan.py`). When each is a copy
from a view of one HF tensor or a constant fill, the parameter's bytes are a pure function of its HF
tensors and that geometry, so they can be produced with plain torch copies, without SGLang. This module
is pure geometry (no I/O, no torch kernels): writes are restricted to an element range (a transfer-slot
chunk), their dimensions merged where both sides are contiguous, runs of the same copy merged into one
strided copy, and copies of the same geometry from different HF tensors (experts, q/k/v) gathered into
one batch that runs as a single `torch._foreach_copy_`. A parameter it cannot compile exactly raises
`NotCompilable` with the reason; the executor then uses SGLang's loader for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from verl_p2p.replica.plan import ParamPlan, RecordedWrite


class NotCompilable(Exception):
    """The parameter's writes cannot be reproduced by plain copies and fills; `reason` says why."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.reason = reason


@dataclass(frozen=True)
class CopyBatch:
    """Copies of the same geometry from several HF tensors into views of the output range.

    Copy i reads `hf_names[i]` (the whole tensor when `src_offset` is None, else its contiguous elements
    viewed as `shape`/`src_stride` at `src_offset`) into the output view `shape`/`dst_stride` at
    `dst_offsets[i]` (elements from the range start). `dst_step` is set when the offsets are evenly spaced,
    so the output views are one strided view unbound in a single call.
    """

    hf_names: tuple[str, ...]
    shape: tuple[int, ...]
    dst_stride: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    dst_step: int | None
    src_offset: int | None
    src_stride: tuple[int, ...]

    @property
    def whole_sources(self) -> bool:
        return self.src_offset is None

    @property
    def numel(self) -> int:
        return _numel(self.shape) * len(self.hf_names)


@dataclass(frozen=True)
class FillOp:
    """A constant fill of the output view `shape`/`stride` at `offset` (elements from the range start)."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    value: float | int | bool


@dataclass(frozen=True)
class CopyProgram:
    """Everything needed to produce elements [start, stop) of one parameter from its HF tensors."""

    param: str
    dtype: torch.dtype
    start: int
    stop: int
    copies: tuple[CopyBatch, ...]
    fills: tuple[FillOp, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @cached_property
    def strided_sources(self) -> frozenset[str]:
        """HF tensors read through element offsets: they must be contiguous when the program runs."""
        return frozenset(n for b in self.copies if not b.whole_sources for n in b.hf_names)

    @cached_property
    def hf_names(self) -> tuple[str, ...]:
        """Every HF tensor the program reads, once each."""
        return tuple(dict.fromkeys(n for b in self.copies for n in b.hf_names))

    @property
    def launches(self) -> int:
        """Batched torch calls the program makes (each batch is one `_foreach_copy_` or one copy)."""
        return len(self.copies) + len(self.fills)

    @property
    def num_copies(self) -> int:
        return sum(len(b.hf_names) for b in self.copies)


# ----------------------------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class _Op:
    """One strided write: dst view (offset, shape, dst_stride); a copy also reads src (offset, src_stride)
    of `hf_name` with the same shape (broadcast dims have src stride 0); a fill has `hf_name` None."""

    dst_offset: int
    shape: tuple[int, ...]
    dst_stride: tuple[int, ...]
    hf_name: str | None = None
    src_offset: int = 0
    src_stride: tuple[int, ...] = ()
    value: float | int | bool | None = None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def _expanded_src_strides(param: str, w: RecordedWrite) -> tuple[int, ...]:
    """Strides of the write's source after `expand(w.shape)` (copy_ broadcasts its source)."""
    s = w.source
    lead = len(w.shape) - len(s.shape)
    if lead < 0:
        raise NotCompilable(param, f"a copy from {s.hf_name} has more source dims than destination dims")
    out = []
    for i, size in enumerate(w.shape):
        j = i - lead
        if j < 0:
            out.append(0)
        elif s.shape[j] == size:
            out.append(s.stride[j] if size != 1 else 0)
        elif s.shape[j] == 1:
            out.append(0)
        else:
            raise NotCompilable(param, f"a copy from {s.hf_name} of shape {s.shape} into {w.shape} does not broadcast")
    return tuple(out)


def _ops_of(p: ParamPlan, hf_specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> list[_Op]:
    """The parameter's writes as `_Op`s, or NotCompilable naming the first write that is not a plain copy/fill."""
    ops = []
    for w in p.writes:
        if w.op == "fill":
            if w.fill_value is None:
                raise NotCompilable(p.name, "SGLang fills it with a tensor value, not a constant")
            ops.append(_Op(w.offset, w.shape, w.stride, value=w.fill_value))
        elif w.op == "copy":
            if w.source is None:
                raise NotCompilable(
                    p.name,
                    f"SGLang copies into it from an intermediate tensor computed from {list(w.feeds)}, "
                    "not from a view of one HF tensor",
                )
            s = w.source
            if s.hf_name not in hf_specs:
                raise NotCompilable(p.name, f"a copy reads {s.hf_name}, which is not in the plan's HF tensors")
            if s.dtype is not None:  # a copy program converts values; this copy reinterprets bits
                raise NotCompilable(
                    p.name,
                    f"SGLang reads the bits of {s.hf_name} ({hf_specs[s.hf_name][1]}) through a {s.dtype} view",
                )
            src_stride = _expanded_src_strides(p.name, w)
            hf_numel = _numel(hf_specs[s.hf_name][0])
            last = s.offset + sum((n - 1) * st for n, st in zip(w.shape, src_stride, strict=True))
            if s.offset < 0 or any(x < 0 for x in src_stride) or last >= hf_numel:
                raise NotCompilable(p.name, f"a copy reads outside {s.hf_name}'s {hf_numel} elements")
            ops.append(_Op(w.offset, w.shape, w.stride, s.hf_name, s.offset, src_stride))
        elif w.op.startswith(("copy[", "fill[")):
            raise NotCompilable(
                p.name, f"SGLang writes it through a {w.op[5:-1]} view of the {p.dtype} parameter ({w.op})"
            )
        else:
            raise NotCompilable(p.name, f"SGLang writes it with {w.op}, which is not a plain copy or constant fill")
    if not ops:
        raise NotCompilable(p.name, "no recorded copy or fill writes it")
    return ops


def _squeeze(op: _Op) -> _Op:
    """Drop size-1 dimensions (their strides are meaningless)."""
    keep = [i for i, s in enumerate(op.shape) if s != 1]
    return _Op(
        op.dst_offset,
        tuple(op.shape[i] for i in keep),
        tuple(op.dst_stride[i] for i in keep),
        op.hf_name,
        op.src_offset,
        tuple(op.src_stride[i] for i in keep) if op.hf_name is not None else (),
        op.value,
    )


def _clip(op: _Op, c0: int, c1: int, out: list[_Op]) -> None:
    """Append the parts of `op` that fall in output elements [c0, c1), offsets made relative to c0.

    Splits along the largest-stride dimension: the indices whose whole span lies inside become one
    narrowed write, the (at most two) straddling ones recurse on the remaining dimensions.
    """
    shape, dstr, sstr, off = op.shape, op.dst_stride, op.src_stride, op.dst_offset
    if any(s == 0 for s in shape):
        return
    extent = sum((s - 1) * st for s, st in zip(shape, dstr, strict=True))
    if off + extent < c0 or off >= c1:
        return
    if off >= c0 and off + extent < c1:
        out.append(_Op(off - c0, shape, dstr, op.hf_name, op.src_offset, sstr, op.value))
        return
    d = max(range(len(shape)), key=lambda i: dstr[i])
    st = dstr[d]
    copy = op.hf_name is not None
    rest_shape = shape[:d] + shape[d + 1 :]
    rest_dstr = dstr[:d] + dstr[d + 1 :]
    rest_sstr = sstr[:d] + sstr[d + 1 :] if copy else ()
    rest = sum((s - 1) * x for s, x in zip(rest_shape, rest_dstr, strict=True))
    first = max(0, -(-(c0 - off - rest) // st))
    last = min(shape[d] - 1, (c1 - 1 - off) // st)
    full_a = max(first, -(-(c0 - off) // st))
    full_b = min(last, (c1 - 1 - off - rest) // st)
    src_step = sstr[d] if copy else 0
    if full_a <= full_b:
        n = full_b - full_a + 1
        out.append(
            _Op(
                off + full_a * st - c0,
                shape[:d] + (n,) + shape[d + 1 :],
                dstr,
                op.hf_name,
                op.src_offset + full_a * src_step,
                sstr,
                op.value,
            )
        )
        edges = list(range(first, full_a)) + list(range(full_b + 1, last + 1))
    else:
        edges = list(range(first, last + 1))
    for i in edges:
        sub = _Op(off + i * st, rest_shape, rest_dstr, op.hf_name, op.src_offset + i * src_step, rest_sstr, op.value)
        _clip(sub, c0, c1, out)


def _coalesce(op: _Op) -> _Op:
    """Merge adjacent dimensions that are contiguous with each other on both sides."""
    if not op.shape:
        return op
    copy = op.hf_name is not None
    shape, dstr = [op.shape[0]], [op.dst_stride[0]]
    sstr = [op.src_stride[0]] if copy else []
    for i in range(1, len(op.shape)):
        s, ds = op.shape[i], op.dst_stride[i]
        ss = op.src_stride[i] if copy else 0
        if dstr[-1] == ds * s and (not copy or sstr[-1] == ss * s):
            shape[-1] *= s
            dstr[-1] = ds
            if copy:
                sstr[-1] = ss
        else:
            shape.append(s)
            dstr.append(ds)
            if copy:
                sstr.append(ss)
    return _Op(op.dst_offset, tuple(shape), tuple(dstr), op.hf_name, op.src_offset, tuple(sstr), op.value)


def _merge_runs(ops: list[_Op]) -> list[_Op]:
    """Merge runs of writes that step evenly through the same source into one strided write (one more dim)."""
    groups: dict[tuple, list[_Op]] = {}
    for op in ops:
        groups.setdefault((op.hf_name, op.value, op.shape, op.dst_stride, op.src_stride), []).append(op)
    out = []
    for group in groups.values():
        group.sort(key=lambda o: o.dst_offset)
        i = 0
        while i < len(group):
            j = i + 1
            dstep = group[j].dst_offset - group[i].dst_offset if j < len(group) else 0
            sstep = group[j].src_offset - group[i].src_offset if j < len(group) else 0
            if j < len(group) and sstep >= 0:  # as_strided takes no negative stride
                while (
                    j + 1 < len(group)
                    and group[j + 1].dst_offset - group[j].dst_offset == dstep
                    and group[j + 1].src_offset - group[j].src_offset == sstep
                ):
                    j += 1
                n = j - i + 1
            else:
                n = 1
            if n == 1:
                out.append(group[i])
                i += 1
                continue
            head = group[i]
            copy = head.hf_name is not None
            merged = _Op(
                head.dst_offset,
                (n,) + head.shape,
                (dstep,) + head.dst_stride,
                head.hf_name,
                head.src_offset,
                ((sstep,) + head.src_stride) if copy else (),
                head.value,
            )
            out.append(_coalesce(merged))
            i += n
    return out


def _batches(
    ops: list[_Op], hf_specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
) -> tuple[tuple[CopyBatch, ...], tuple[FillOp, ...]]:
    """Gather copies of the same geometry into batches; a copy of a whole contiguous HF tensor is taken in
    the tensor's own shape, so the tensor itself is the source (no view to build when the program runs)."""
    groups: dict[tuple, list[tuple[int, str, int]]] = {}
    fills = []
    for op in ops:
        if op.hf_name is None:
            fills.append(FillOp(op.dst_offset, op.shape, op.dst_stride, op.value))
            continue
        hf_shape = tuple(hf_specs[op.hf_name][0])
        whole = (
            len(op.shape) == 1
            and op.dst_stride == (1,)
            and op.src_stride == (1,)
            and op.src_offset == 0
            and op.shape[0] == _numel(hf_shape)
        )
        if whole:
            key = (hf_shape, _contiguous_strides(hf_shape), None, ())
        else:
            key = (op.shape, op.dst_stride, "strided", op.src_stride)
        groups.setdefault(key, []).append((op.dst_offset, op.hf_name, op.src_offset))
    batches = []
    for (shape, dst_stride, kind, src_stride), members in groups.items():
        if kind is None:
            runs = [members]
        else:  # strided sources: one batch per source offset (the view is built with it)
            by_src: dict[int, list] = {}
            for m in members:
                by_src.setdefault(m[2], []).append(m)
            runs = list(by_src.values())
        for run in runs:
            run.sort()
            offsets = tuple(m[0] for m in run)
            step = offsets[1] - offsets[0] if len(offsets) > 1 else None
            if step is not None and any(b - a != step for a, b in zip(offsets[:-1], offsets[1:], strict=True)):
                step = None
            batches.append(
                CopyBatch(
                    hf_names=tuple(m[1] for m in run),
                    shape=shape,
                    dst_stride=dst_stride,
                    dst_offsets=offsets,
                    dst_step=step,
                    src_offset=None if kind is None else run[0][2],
                    src_stride=src_stride,
                )
            )
    batches.sort(key=lambda b: b.dst_offsets[0])
    fills.sort(key=lambda f: f.offset)
    return tuple(batches), tuple(fills)


def compile_param(
    p: ParamPlan,
    hf_specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    start: int = 0,
    stop: int | None = None,
) -> CopyProgram:
    """The copy program producing elements [start, stop) of parameter `p`; NotCompilable if it has none."""
    stop = p.numel if stop is None else stop
    if not 0 <= start < stop <= p.numel:
        raise ValueError(f"{p.name}: element range [{start}, {stop}) is not inside its {p.numel} elements")
    clipped: list[_Op] = []
    for op in _ops_of(p, hf_specs):
        _clip(_squeeze(op), start, stop, clipped)
    ops = _merge_runs([_coalesce(op) for op in clipped])
    covered = sum(_numel(op.shape) for op in ops)
    if covered != stop - start:  # the plan was validated; this guards the geometry above
        raise NotCompilable(p.name, f"the compiled writes cover {covered} of {stop - start} elements")
    copies, fills = _batches(ops, hf_specs)
    return CopyProgram(p.name, p.dtype, start, stop, copies, fills)


def compilable(p: ParamPlan, hf_specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> str | None:
    """None when `p` compiles; else the reason it does not."""
    try:
        _ops_of(p, hf_specs)
    except NotCompilable as exc:
        return exc.reason
    return None


__all__ = ["CopyBatch", "CopyProgram", "FillOp", "NotCompilable", "compilable", "compile_param"]

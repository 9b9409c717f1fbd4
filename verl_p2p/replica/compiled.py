"""The compiled executor: a rollout rank's exact bytes from its HF tensors with plain torch copies.

`CompiledReplica` wraps a `RankReplica` (the reference executor: SGLang's own `load_weights` per
parameter) and serves the same interface push uses (`key`, `plan`, `stager`, `load`, `chunks`,
`load_chunk`). Each parameter's recorded writes are compiled once (`program.py`) into batched strided
copies and fills that run on the device holding the HF tensors: on a trainer GPU the conversion runs at
copy speed, with no SGLang call and no Python call per expert. A parameter that cannot be compiled falls
back to the reference executor (logged once, with the reason).

When the destination is on another device (pinned host slots, CUDA HF tensors), the program runs into a
scratch buffer on the tensors' device and the result is copied over once, contiguously. Copies are
asynchronous on CUDA: the caller synchronizes before the bytes are read (push does, before each submit).

`verify_next_push()` arms a byte-for-byte check of the next load of every parameter against the reference
executor; the first difference raises `CompiledPlanMismatchError` naming the parameter and the rank.
`prepare_push(slot_bytes, verify=True)` does both before any push: it compiles every program the push will run
(whole parameters, or the slot-sized chunks of those larger than a slot) and checks each against SGLang's loader
on synthetic HF tensors into scratch memory. A program is a function of the write plan, not of the values, so
this is the first push's check without holding the rollout paused for it.
"""

from __future__ import annotations

import hashlib
import logging
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl_p2p.errors import P2PError
from verl_p2p.replica.plan import ParamPlan, WritePlan
from verl_p2p.replica.program import CopyBatch, CopyProgram, NotCompilable, compilable, compile_param
from verl_p2p.replica.stream import CompletenessStager, ReplicaLoadError, _typed_view, check_chunk

logger = logging.getLogger(__name__)

EXECUTORS = ("compiled", "sglang")


class CompiledPlanMismatchError(P2PError):
    """The compiled executor produced bytes that differ from SGLang's loader (the reference executor)."""


class CompiledReplica:
    """HF tensors -> one rollout rank's exact bytes by compiled copy programs; SGLang's loader where needed."""

    def __init__(self, reference: Any, verify_first_push: bool = False) -> None:
        self.reference = reference
        self.key = reference.key
        self.plan: WritePlan = reference.plan
        self.programs: dict[tuple[str, int, int], CopyProgram] = {}
        # the planned shape of every HF tensor, as torch.Size: one compare per feed in `_feeds`
        self._shapes = {n: torch.Size(shape) for n, (shape, _) in self.plan.hf_specs.items()}
        self.fallbacks: dict[str, str] = {}
        for name, p in self.plan.params.items():
            reason = compilable(p, self.plan.hf_specs)
            if reason is not None:
                self.fallbacks[name] = reason
        self._verify_pending: set[str] = set()
        # fallbacks already logged: the session keeps one executor per replica key, so each is logged once
        self._logged_fallbacks: set[str] = set()
        self._verify_full: tuple[str, torch.Tensor] | None = None  # reference bytes of the param being chunked
        self._log_fallbacks()
        if verify_first_push:
            self.verify_next_push()

    # ------------------------------------------------------------------ the RankReplica interface
    @property
    def layout(self) -> Any:
        return self.reference.layout

    @property
    def rank(self) -> int:
        return self.reference.layout.tp_rank

    def stager(self) -> CompletenessStager:
        return self.reference.stager()

    def chunks(self, param_name: str, max_bytes: int) -> list[tuple[int, int]]:
        return self.reference.chunks(param_name, max_bytes)

    def load(self, param_name: str, hf_tensors: Mapping[str, torch.Tensor], dst: torch.Tensor) -> None:
        """Fill `dst` (1-D uint8, exactly the parameter's bytes) with what the rollout rank holds."""
        p = self._plan(param_name)
        _typed_view(dst, p.nbytes, p.dtype, param_name)
        if param_name in self.fallbacks:
            self.reference.load(param_name, hf_tensors, dst)  # SGLang's loader: nothing to verify against
            self._verify_pending.discard(param_name)
        else:
            self._run(self._program(p, 0, p.numel), hf_tensors, dst)
        if param_name in self._verify_pending:
            self._verify(p, hf_tensors, 0, dst)

    def load_chunk(
        self, param_name: str, hf_tensors: Mapping[str, torch.Tensor], byte_offset: int, dst: torch.Tensor
    ) -> None:
        """Fill `dst` with bytes [byte_offset, byte_offset + dst.numel()) of the parameter."""
        p = self._plan(param_name)
        es = check_chunk(p, byte_offset, dst.numel())
        if param_name in self.fallbacks:
            self.reference.load_chunk(param_name, hf_tensors, byte_offset, dst)
        else:
            _typed_view(dst, dst.numel(), p.dtype, param_name)
            start = byte_offset // es
            self._run(self._program(p, start, start + dst.numel() // es), hf_tensors, dst)
        if param_name in self._verify_pending:
            self._verify(p, hf_tensors, byte_offset, dst)

    # ------------------------------------------------------------------ verification
    def verify_next_push(self) -> None:
        """Check the next load of every parameter against the reference executor, byte for byte."""
        self._verify_pending = set(self.plan.params)
        self._verify_full = None

    @property
    def verifying(self) -> bool:
        return bool(self._verify_pending)

    def prepare_push(self, slot_bytes: int, verify: bool = True, device: torch.device | None = None) -> int:
        """Compile every program a push with slots of `slot_bytes` runs and, with `verify`, check each against
        the reference executor now: synthetic HF tensors (seeded per name) on `device`, scratch outputs, nothing
        sent. Returns the number of parameters checked; raises CompiledPlanMismatchError on a difference."""
        device = torch.device("cpu") if device is None else device
        checked = 0
        for name, p in self.plan.params.items():
            if name in self.fallbacks or p.nbytes == 0:
                continue  # SGLang's loader itself: nothing compiled, nothing to check
            ranges = self.chunks(name, slot_bytes) if p.nbytes > slot_bytes or not p.feeds else [(0, p.nbytes)]
            es = p.dtype.itemsize
            for offset, length in ranges:
                self._program(p, offset // es, (offset + length) // es)
            if not verify:
                continue
            feeds = {f: synthetic_hf_tensor(f, *self.plan.hf_specs[f], device=device) for f in p.feeds}
            self._verify_pending.add(name)
            self._verify_full = None
            for offset, length in ranges:
                dst = torch.empty(length, dtype=torch.uint8, device=device)
                if ranges == [(0, p.nbytes)]:
                    self.load(name, feeds, dst)
                else:
                    self.load_chunk(name, feeds, offset, dst)
            self._verify_pending.discard(name)
            self._verify_full = None
            checked += 1
        return checked

    def _verify(self, p: ParamPlan, hf_tensors: Mapping[str, torch.Tensor], byte_offset: int, dst: torch.Tensor):
        if self._verify_full is None or self._verify_full[0] != p.name:
            want = torch.empty(p.nbytes, dtype=torch.uint8, device=dst.device)
            self.reference.load(p.name, hf_tensors, want)
            self._verify_full = (p.name, want)
        want = self._verify_full[1][byte_offset : byte_offset + dst.numel()]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the compiled copies (and a copy into pinned memory) are asynchronous
        if not _bytes_equal(dst, want):
            where = int((dst != want).nonzero()[0, 0]) + byte_offset
            element = where // p.dtype.itemsize
            path = "SGLang's loader (fallback)" if p.name in self.fallbacks else "the compiled program"
            raise CompiledPlanMismatchError(
                f"parameter {p.name} of rollout rank {self.rank}: {path} differs from SGLang's loader "
                f"from byte {where} (element {element} of {p.numel}); nothing of it was sent. Set "
                "engine_kwargs.p2p.executor=sglang to push through SGLang's loader, and report this layout"
            )
        if byte_offset + dst.numel() >= p.nbytes:
            self._verify_pending.discard(p.name)
            self._verify_full = None

    # ------------------------------------------------------------------ compiled programs
    def _plan(self, param_name: str) -> ParamPlan:
        try:
            return self.plan.params[param_name]
        except KeyError:
            raise ReplicaLoadError(f"{param_name} is not a parameter of rollout rank {self.rank}") from None

    def program(self, param_name: str, start: int = 0, stop: int | None = None) -> CopyProgram:
        """The compiled program for elements [start, stop) of a parameter (compiled once, then cached)."""
        p = self._plan(param_name)
        return self._program(p, start, p.numel if stop is None else stop)

    def _program(self, p: ParamPlan, start: int, stop: int) -> CopyProgram:
        key = (p.name, start, stop)
        prog = self.programs.get(key)
        if prog is None:
            try:
                prog = compile_param(p, self.plan.hf_specs, start, stop)
            except NotCompilable as exc:  # compilable() passed: the geometry itself failed
                raise ReplicaLoadError(f"cannot compile {exc}") from exc
            self.programs[key] = prog
        return prog

    def _log_fallbacks(self) -> None:
        new = {n: r for n, r in self.fallbacks.items() if n not in self._logged_fallbacks}
        if not new:
            return
        self._logged_fallbacks.update(new)
        logger.warning(
            "compiled executor: %d parameter(s) of rollout rank %s use SGLang's loader instead: %s",
            len(new),
            self.rank,
            "; ".join(f"{n} ({r})" for n, r in new.items()),
        )

    def _run(self, prog: CopyProgram, hf_tensors: Mapping[str, torch.Tensor], dst: torch.Tensor) -> None:
        feeds = self._feeds(prog, hf_tensors)
        device = next(iter(feeds.values())).device if feeds else dst.device
        if any(t.device != device for t in feeds.values()):
            feeds = {n: t.to(device) for n, t in feeds.items()}
        out = dst if dst.device == device else torch.empty(dst.numel(), dtype=torch.uint8, device=device)
        with torch.no_grad():
            run_program(prog, feeds, out.view(prog.dtype))
            if out is not dst:
                dst.copy_(out, non_blocking=dst.is_pinned() or dst.device.type == "cuda")

    def _feeds(self, prog: CopyProgram, hf_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The program's HF tensors, each checked against the shape the plan was built for. This runs once per
        HF tensor of every push (an FP8 MoE rank has thousands): one lookup and one shape compare per tensor."""
        shapes = self._shapes
        feeds = {}
        for n in prog.hf_names:
            t, shape = hf_tensors.get(n), shapes[n]
            if t is None or t.shape != shape:
                if t is None:
                    raise ReplicaLoadError(f"{prog.param} needs HF tensor {n}, which was not given")
                raise ReplicaLoadError(
                    f"HF tensor {n} has shape {tuple(t.shape)}, the plan was built for {tuple(shape)}"
                )
            feeds[n] = t
        for n in prog.strided_sources:
            if not feeds[n].is_contiguous():
                feeds[n] = feeds[n].contiguous()
        return feeds


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`torch.equal` of two 1-D uint8 tensors, compared in the widest integer words both allow (on a CPU a
    byte-wise compare was 3x slower than 8-byte words, measured; it was most of a verified push's extra cost)."""
    if a.numel() != b.numel():
        return False
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if a.numel() % size == 0 and a.data_ptr() % size == 0 and b.data_ptr() % size == 0:
            try:
                return torch.equal(a.view(word), b.view(word))
            except RuntimeError:  # a view this build refuses: compare bytes
                break
    return torch.equal(a, b)


def run_program(prog: CopyProgram, feeds: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Execute `prog` into `out` (1-D, the program's element range, the parameter's dtype)."""
    base = out.storage_offset()
    for b in prog.copies:
        srcs = [feeds[n] for n in b.hf_names]
        offsets, all_of_batch = b.dst_offsets, True
        runs = stacked_runs(b, srcs) if b.dst_step is not None and len(srcs) > 1 else []
        if runs:
            for start, view in runs:  # one copy per run of sources lying at one step in one storage
                out.as_strided(view.shape, (b.dst_step, *b.dst_stride), base + offsets[start]).copy_(view)
            covered = {i for start, view in runs for i in range(start, start + view.shape[0])}
            rest = [i for i in range(len(srcs)) if i not in covered]
            if not rest:
                continue
            srcs, offsets, all_of_batch = [srcs[i] for i in rest], [offsets[i] for i in rest], False
        if b.src_offset is not None:
            srcs = [t.as_strided(b.shape, b.src_stride, t.storage_offset() + b.src_offset) for t in srcs]
        if b.dst_step is not None and all_of_batch:
            dsts = out.as_strided((len(srcs),) + b.shape, (b.dst_step,) + b.dst_stride, base + b.dst_offsets[0])
            dsts = dsts.unbind(0)
        else:
            dsts = [out.as_strided(b.shape, b.dst_stride, base + o) for o in offsets]
        if len(srcs) == 1:
            dsts[0].copy_(srcs[0])
        else:
            torch._foreach_copy_(list(dsts), srcs)
    for f in prog.fills:
        out.as_strided(f.shape, f.stride, base + f.offset).fill_(f.value)


def stacked_runs(b: CopyBatch, srcs: Sequence[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """Runs of at least two consecutive sources that lie at one constant step in one storage, each as one
    [length, *shape] view: (first index, view). A batch of the FP8 quantizer's output is such a run (or a few,
    where the quantizer's batches end), and so are experts exported from one grouped tensor; each run is one copy
    instead of a view per source and a multi-tensor copy (those views were a large share of an FP8 conversion's
    host time: docs/measurements/bench_convert_fp8_h200_profile_s9.json).

    Every source's address and dtype is checked (and, for whole sources, its shape and contiguity), the run's
    first and last sources must share a storage, and the view is bounds-checked by torch against it: sources that
    merely sit side by side in separate allocations are copied one by one."""
    whole = b.src_offset is None
    first = srcs[0]
    shape = first.shape
    if whole and tuple(shape) != b.shape:
        return []
    # one C-level pass per property, not a Python loop body per source: this runs for thousands of expert tensors
    # per push (measured on meta tensors, the checks are ~0.3 us per source this way, ~0.7 us as a loop)
    if len({t.dtype for t in srcs}) != 1:
        return []
    if whole and (len({t.shape for t in srcs}) != 1 or not all(map(torch.Tensor.is_contiguous, srcs))):
        return []
    ptrs = list(map(torch.Tensor.data_ptr, srcs))
    es, n, runs, i = first.element_size(), len(srcs), [], 0
    steps = list(map(operator.sub, ptrs[1:], ptrs[:-1]))  # steps[k]: source k to source k + 1
    while i < n - 1:
        step, j = steps[i], i + 1
        while j + 1 < n and steps[j] == step:
            j += 1
        view = _run_view(b, srcs[i], srcs[j], j - i + 1, step, es) if step > 0 and step % es == 0 else None
        if view is not None:
            runs.append((i, view))
            i = j + 1
        else:
            i += 1
    return runs


def _run_view(b: CopyBatch, head: torch.Tensor, tail: torch.Tensor, length: int, step: int, es: int):
    """`length` sources from `head` to `tail` at `step` bytes as one view of head's storage, or None."""
    if head.untyped_storage().data_ptr() != tail.untyped_storage().data_ptr():
        return None
    stride = head.stride() if b.src_offset is None else b.src_stride
    offset = head.storage_offset() + (0 if b.src_offset is None else b.src_offset)
    try:
        return head.as_strided((length, *b.shape), (step // es, *stride), offset)
    except RuntimeError:  # beyond head's storage
        return None


def synthetic_hf_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """A stand-in for HF tensor `name`: distinct values (normal, seeded by the name), so a misplaced element shows."""
    device = torch.device("cpu") if device is None else torch.device(device)
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") % 2**63
    generator = torch.Generator(device=device).manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(tuple(shape), generator=generator, dtype=torch.float32, device=device).to(dtype)
    return torch.randint(0, 127, tuple(shape), generator=generator, dtype=torch.int64, device=device).to(dtype)


def make_executor(replica: Any, executor: str = "compiled", verify_first_push: bool = False) -> Any:
    """The executor push uses for `replica`: the compiled one, or the RankReplica itself (`sglang`)."""
    if executor == "sglang":
        return replica
    if executor == "compiled":
        return CompiledReplica(replica, verify_first_push=verify_first_push)
    raise ValueError(f"executor={executor!r}: choose one of {list(EXECUTORS)}")


__all__ = [
    "EXECUTORS",
    "CompiledPlanMismatchError",
    "CompiledReplica",
    "make_executor",
    "run_program",
    "synthetic_hf_tensor",
]

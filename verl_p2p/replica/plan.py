"""The write plan of one rollout rank: which HF tensors feed each parameter, and where their bytes land.

The rank's SGLang model is built on `meta` (no memory) and its own `load_weights` runs once over meta HF
tensors of the checkpoint's names and shapes, under a dispatch mode that records every write into a
parameter's storage: the op, the destination geometry, and where the data came from. That gives each
parameter's feeds (what it waits for), the geometry to replay writes by byte range (for parameters larger
than a transfer slot) and SGLang's padding fills. The plan is validated before use: every parameter byte
written exactly once, and (across ranks) every HF tensor used somewhere.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from verl_p2p.replica.derived import derivation_of, forget_derived, unexplained

# the checks of a finished plan live in plan_checks.py; imported here for capture and re-exported for callers
from verl_p2p.replica.plan_checks import (  # noqa: F401
    WritePlanError,
    check_hf_coverage,
    check_syncable,
    validate_write_plan,
)
from verl_p2p.replica.plan_types import HFSpecs, ParamPlan, RecordedWrite, SourceView, WritePlan  # noqa: F401
from verl_p2p.replica.rank_context import RankContext

logger = logging.getLogger(__name__)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, n = [], 1
    for size in reversed(shape):
        stride.append(n)
        n *= size
    return tuple(reversed(stride))


def _scalar(value):
    if isinstance(value, torch.Tensor):
        return None
    return value


def _tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments (tensors and tensor lists: schemas nest no deeper)."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


class _WriteRecorder(TorchDispatchMode):
    """Records writes into parameter storages and tracks which HF tensors every storage's data came from.

    It sees every op `load_weights` runs, most of them SGLang's bookkeeping on small CPU tensors (the expert
    map lookups of every expert of every layer), so the common cases are kept cheap: ops without a meta
    tensor are passed through (checkpoint data only ever lives on meta here), the mutated arguments of an
    op are found once per op from its schema, and ops that neither write nor read checkpoint-derived data
    only forget the origin of the storages they create.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], hf: Mapping[str, torch.Tensor]):
        super().__init__()
        self.param_of = {_storage_key(p): name for name, p in params.items()}
        self.dtype_of = {name: p.dtype for name, p in params.items()}
        self.hf_of = {_storage_key(t): name for name, t in hf.items()}
        self.hf_dtype = {name: t.dtype for name, t in hf.items()}
        # storage -> the HF tensors its data came from (only non-empty origins are kept)
        self.origins: dict[int, frozenset[str]] = {k: frozenset([n]) for k, n in self.hf_of.items()}
        self.writes: dict[str, list[RecordedWrite]] = {name: [] for name in params}
        self.input_mutations: list[tuple[str, str]] = []
        self._mutated_args: dict = {}
        # storage of a dim-0 concatenation of whole HF tensors -> [(hf name, rows)] (DeepSeek's fused q_a/kv_a)
        self.concats: dict[int, list[tuple[str, int]]] = {}

    def _mutated(self, func) -> tuple[tuple[int, str], ...]:
        found = self._mutated_args.get(func)
        if found is None:
            found = tuple(
                (i, a.name)
                for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            )
            self._mutated_args[func] = found
        return found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _tensors_in(args, kwargs)
        outs = out if isinstance(out, (list, tuple)) else (out,)
        if not any(t.is_meta for t in inputs) and not any(isinstance(o, torch.Tensor) and o.is_meta for o in outs):
            # SGLang's bookkeeping on real (CPU) tensors: parameters, HF tensors and all their data are on meta
            return out
        origins = self.origins
        in_keys = [_storage_key(t) for t in inputs]
        mutated = self._mutated(func)
        written: list[torch.Tensor] = []
        for i, name in mutated:
            value = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                written.append(value)
            elif isinstance(value, (list, tuple)):
                written.extend(v for v in value if isinstance(v, torch.Tensor))
        written_keys = {_storage_key(t) for t in written}
        origin = frozenset()
        for key in in_keys:
            if key not in written_keys:
                o = origins.get(key)
                if o:
                    origin = origin | o
        for t in written:
            key = _storage_key(t)
            if key in self.param_of:
                self._record(func, t, args, origin)
            elif key in self.hf_of:
                self.input_mutations.append((self.hf_of[key], str(func)))
            if origin:
                origins[key] = origins.get(key, frozenset()) | origin
        if func is torch.ops.aten.cat.default:
            self._note_concat(args, kwargs, out)
        if not written:
            for o in outs:
                if isinstance(o, torch.Tensor):
                    key = _storage_key(o)
                    if key not in in_keys:  # a new storage (views share their input's)
                        if origin:
                            origins[key] = origin
                        else:
                            origins.pop(key, None)
        return out

    def _note_concat(self, args, kwargs, out: torch.Tensor) -> None:
        """Remember `out` when it concatenates whole HF tensors along dim 0 (a copy from it splits by source)."""
        tensors = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if not tensors or (dim if dim >= 0 else dim + out.dim()) != 0:
            return
        parts = []
        for t in tensors:
            hf = self.hf_of.get(_storage_key(t))
            if hf is None or t.storage_offset() != 0 or not t.is_contiguous() or t.dim() != out.dim():
                return
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                return  # a view of part of the HF tensor
            parts.append((hf, t.shape[0]))
        self.concats[_storage_key(out)] = parts

    def _concat_writes(self, dst: torch.Tensor, src: torch.Tensor, op: str) -> list[RecordedWrite] | None:
        """A copy of a whole recorded concatenation, as one replayable copy per HF tensor (rows of `dst`)."""
        parts = self.concats.get(_storage_key(src))
        if parts is None or src.storage_offset() != 0 or not src.is_contiguous() or dst.shape != src.shape:
            return None
        writes, row = [], 0
        for hf, rows in parts:
            shape = (rows, *src.shape[1:])
            stride = _contiguous_stride(shape)
            writes.append(
                RecordedWrite(
                    op=op,
                    offset=dst.storage_offset() + row * dst.stride(0),
                    shape=shape,
                    stride=tuple(dst.stride()),
                    source=SourceView(hf, 0, shape, stride),
                    feeds=(hf,),
                )
            )
            row += rows
        return writes

    def _record(self, func, dst: torch.Tensor, args, origin: frozenset[str]) -> None:
        name = self.param_of[_storage_key(dst)]
        op, source, value = str(func), None, None
        if func is torch.ops.aten.copy_.default and dst.dtype == self.dtype_of[name]:
            split = self._concat_writes(dst, args[1], "copy")
            if split is not None:
                self.writes[name].extend(split)
                return
        if func is torch.ops.aten.copy_.default:
            op = "copy"
            src = args[1]
            src_name = self.hf_of.get(_storage_key(src))
            if src_name is not None:
                reinterpreted = src.dtype if src.dtype != self.hf_dtype[src_name] else None
                source = SourceView(
                    src_name, src.storage_offset(), tuple(src.shape), tuple(src.stride()), reinterpreted
                )
        elif func is torch.ops.aten.fill_.Scalar:
            op, value = "fill", _scalar(args[1])
        elif func is torch.ops.aten.zero_.default:
            op, value = "fill", 0
        if dst.numel() == 0:
            return
        self.writes[name].append(
            RecordedWrite(
                op=op if dst.dtype == self.dtype_of[name] else f"{op}[{dst.dtype}]",
                offset=dst.storage_offset(),
                shape=tuple(dst.shape),
                stride=tuple(dst.stride()),
                source=source,
                fill_value=value,
                feeds=tuple(sorted(origin)),
            )
        )

    def derived_tensors(self, model: torch.nn.Module) -> dict[str, frozenset[str]]:
        """Module tensors that are not parameters but hold data computed from the checkpoint, each with the
        HF tensors its data came from.

        SGLang builds some after loading (e.g. DeepSeek's MLA `w_kc`/`w_vc` from `kv_b_proj` in
        `post_load_weights`). A rollout registers only its parameters for remote writes, so such a tensor
        is right after a p2p sync only if SGLang derives it again from written parameters (`derived.py`).
        """
        params = set(self.param_of)
        found = {}
        for module_name, module in model.named_modules():
            attrs = {**module._buffers, **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
            for attr, t in attrs.items():
                if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) or not t.is_meta:
                    continue
                key = _storage_key(t)
                if key not in params and self.origins.get(key):
                    found[f"{module_name}.{attr}" if module_name else attr] = self.origins[key]
        return found


def build_meta_model(ctx: RankContext) -> torch.nn.Module:
    """The rank's SGLang model with every parameter on `meta`, built by SGLang's own model class."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import get_model_architecture, set_default_torch_dtype

    from verl_p2p.replica.fp8 import block_rule_refusal, rank_quant_config
    from verl_p2p.replica.model_class import refuse_unsupported_class

    with ctx:
        # Importing model modules creates real tensors at module level: do it before entering meta.
        cls, _ = get_model_architecture(ctx.model_config)
        refuse_unsupported_class(cls)
        load_config = LoadConfig(load_format="auto", tp_rank=ctx.layout.tp_rank)
        quant_config = rank_quant_config(ctx.model_config, load_config)
        with (
            block_rule_refusal(ctx.layout),
            set_default_torch_dtype(ctx.model_config.dtype),
            host_device_answer(ctx),
            torch.device("meta"),
        ):
            model = _initialize_model(ctx.model_config, load_config, quant_config)
    return model.eval()


def host_has_accelerator() -> bool:
    """Whether this (trainer) host can place tensors where a CUDA rollout rank does."""
    return torch.cuda.is_available()


@contextmanager
def host_device_answer(ctx: RankContext) -> Iterator[str | None]:
    """Inside the active rank context `ctx`: model classes that ask SGLang for the device while being built (MLA's
    yarn rope: `get_rope_wrapper(device=...)`) are answered `cpu` on a host without an accelerator.

    The rollout's `/server_info` says `cuda`; SGLang then asks the platform, which raises "No accelerator" on a CPU
    trainer host. Only buffers SGLang computes at start-up (rope caches) take that device; they are never published
    nor written, so the plan's bytes are the same either way. Yields the device answered, or None where the
    question is left to SGLang (a host with an accelerator).
    """
    if host_has_accelerator():
        yield None
        return
    bag = _runtime_device_bag()
    if bag is not None:  # SGLang 0.5.21 on: the active runtime context's device bag
        with bag.override(device="cpu"):
            yield "cpu"
        return
    record = ctx.server_args  # up to 0.5.19: the rank's ServerArgs record, the process's global while active
    previous = record.device
    record.device = "cpu"
    try:
        yield "cpu"
    finally:
        record.device = previous


def _runtime_device_bag():
    """The active runtime context's device bag (SGLang 0.5.21 on), else None (module-global releases)."""
    try:
        from sglang.srt.runtime_context import get_device
    except ImportError:
        return None
    return get_device()


def meta_hf_tensors(hf_specs: HFSpecs) -> dict[str, torch.Tensor]:
    return {name: torch.empty(tuple(shape), dtype=dtype, device="meta") for name, (shape, dtype) in hf_specs.items()}


@contextmanager
def _gc_paused() -> Iterator[None]:
    """A capture allocates ~10 objects per HF tensor; with SGLang loaded the heap holds ~700k objects, and the
    collections those allocations trigger cost ~20% of a capture (measured). Nothing cyclic is freed meanwhile."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def _expert_map_lookups_unrecorded() -> Iterator[None]:
    """SGLang's expert weight loader asks the expert-location map (a CPU tensor) where every logical expert of
    every layer lives, also for experts other ranks hold; under the recorder each of those small CPU ops pays
    the dispatch mode's Python entry (a third of a capture at 128 experts x 94 layers, measured). The answers
    are the same with the recorder off (no meta tensor is involved), so they are computed outside it, once per
    question. Call inside the rank context; without such a map (dense models, other releases) nothing changes.
    """
    try:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    except ImportError:  # pragma: no cover - every tested release has it
        yield
        return
    metadata = get_global_expert_location_metadata()
    original = getattr(metadata, "logical_to_all_physical", None)
    if metadata is None or original is None or "logical_to_all_physical" in vars(metadata):
        yield
        return
    answers: dict[tuple, list[int]] = {}

    def logical_to_all_physical(layer_id, logical_expert_id, require_global_experts=False):
        question = (layer_id, logical_expert_id, require_global_experts)
        answer = answers.get(question)
        if answer is None:
            with _disable_current_modes():
                answer = answers[question] = list(original(layer_id, logical_expert_id, require_global_experts))
        return list(answer)

    metadata.logical_to_all_physical = logical_to_all_physical
    try:
        yield
    finally:
        del metadata.logical_to_all_physical


def rollout_local_params(params: dict[str, torch.Tensor], writes: dict[str, list]) -> tuple[str, ...]:
    """Parameters SGLang marks `_skip_weight_check` that the loader never wrote: constants of the rollout itself
    (an FP8 checkpoint without kv-cache scales: the attention's `k_scale`/`v_scale` start at -1 and post-processing
    sets them to 1.0). No trainer tensor maps to them and a sync must not touch them; a checkpoint that does hold
    such a tensor feeds the parameter, which is then planned and written like any other."""
    return tuple(name for name, p in params.items() if getattr(p, "_skip_weight_check", False) and not writes.get(name))


def _rehome_to_meta(model: torch.nn.Module) -> list[str]:
    """Parameters SGLang allocated on the current device itself (Qwen3-Next's gated-delta-net norms), moved to
    `meta` with their attributes (weight loaders): on the rollout they live on its GPU like every other
    parameter, so the capture sees them as the loader will. Returns their names."""
    moved = []
    for module_name, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type == "meta":
                continue
            new = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            new.__dict__.update(p.__dict__)
            module._parameters[name] = new
            moved.append(f"{module_name}.{name}" if module_name else name)
    if moved:
        logger.info("p2p plan: %d parameter(s) SGLang built on a real device moved to meta: %s", len(moved), moved[:4])
    return moved


def capture_write_plan(ctx: RankContext, model: torch.nn.Module, hf_specs: HFSpecs) -> WritePlan:
    """Run SGLang's `load_weights` once over meta HF tensors and record every parameter write."""
    _rehome_to_meta(model)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if p.device.type != "meta":
            raise WritePlanError(f"parameter {name} was built on {p.device}, not meta: SGLang allocated it directly")
        if not p.is_contiguous() or p.storage_offset() != 0:
            raise WritePlanError(f"parameter {name} is not a contiguous tensor at offset 0; cannot address its bytes")
    with _gc_paused():
        hf = meta_hf_tensors(hf_specs)
        recorder = _WriteRecorder(params, hf)
        with ctx, torch.no_grad(), _expert_map_lookups_unrecorded(), recorder:
            model.load_weights(iter(list(hf.items())))
    if recorder.input_mutations:
        raise WritePlanError(
            f"SGLang's loader modifies its input HF tensors in place ({recorder.input_mutations[:3]}); "
            "the replica would corrupt the caller's tensors"
        )
    derived = recorder.derived_tensors(model)
    forget_derived(model)
    order = {n: i for i, n in enumerate(hf_specs)}
    local = rollout_local_params(params, recorder.writes)
    plans = {}
    for name, p in params.items():
        if name in local:
            continue
        writes = tuple(recorder.writes[name])
        feeds = sorted({f for w in writes for f in w.feeds}, key=order.__getitem__)
        plans[name] = ParamPlan(
            name=name,
            shape=tuple(p.shape),
            dtype=p.dtype,
            nbytes=p.numel() * p.element_size(),
            feeds=tuple(feeds),
            writes=writes,
        )
    plan = WritePlan(
        params=plans,
        hf_specs={k: (tuple(s), d) for k, (s, d) in hf_specs.items()},
        derived=tuple(derived),
        local=local,
    )
    validate_write_plan(plan)
    feeds = {name: p.feeds for name, p in plans.items()}
    listed = {n: o for n, o in derived.items() if derivation_of(n, plans) is not None}
    impure = unexplained(listed, feeds)
    if impure:
        raise WritePlanError(
            "SGLang derives tensors of this model from more than the parameters a p2p sync writes, so its "
            f"session end would not rebuild them from the new weights: {impure}"
        )
    return plan

"""PP-local HF export: each pipeline stage yields only its own HF tensors, under global names.

Megatron-Bridge's export walks the *global* parameter list on every rank and broadcasts each tensor from its
owning stage to all others, so every stage waits on every other and each receives the whole model. Here a stage
walks only its own conversion tasks, each with a copy of its mapping whose pipeline group is a size-1 stand-in:
the bridge's `pp_size == 1` path skips the cross-stage broadcasts while the TP/EP gathers run for real inside
the stage. The tensors still come out of the bridge's own stream, so names (global layer and expert numbers),
transforms, tied-embedding handling, grouped experts and export hooks are the bridge's.

Where that cannot apply (blockwise-FP8 export tasks, FP8 parameters, QAT/ModelOpt quantizers, LoRA adapters
to merge) the fallback runs the bridge's full export and keeps the tensors this stage owns; the reason is
logged. The full export crosses stages, so in that mode every rank of the model must iterate together.

Every rank of a stage must iterate the stream to the end, senders or not (the TP/EP gathers are collectives):
see `export_stage.drive_export`. This module imports only torch and Megatron-Bridge (no verl), so the GPU check
script can use it alone.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from verl_p2p.errors import P2PError

logger = logging.getLogger(__name__)

ExportMode = Literal["auto", "pp_local", "filter_full"]
HFTensor = tuple[str, torch.Tensor]

_LAYER_PREFIX = re.compile(r"^(.*?\blayers\.\d+)\.")


class ExportError(P2PError):
    """The PP-local export cannot run for this model or bridge (the message says why and what to use)."""


@dataclass(frozen=True)
class ModeChoice:
    """The export path a stage takes, and why (logged when it is the fallback)."""

    mode: Literal["pp_local", "filter_full"]
    reason: str


class _SingleStagePPGroup:
    """Pipeline-group stand-in on the copied mappings: size 1, rank 0, so the bridge takes its no-PP path.

    Any other use means a mapping tried to communicate across stages through it: that raises.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ExportError(
            f"the stage-local pipeline group was asked for {name!r}: a Megatron-Bridge mapping communicates "
            "across pipeline stages outside its pp_size == 1 path; use mode='filter_full' for this model"
        )

    def __repr__(self) -> str:
        return "<single-stage pp group stand-in>"


class _PGCollectionWithStagePP:
    """A ProcessGroupCollection view whose `pp` is the stand-in (lazily built delegates inherit it)."""

    def __init__(self, base: Any, pp: _SingleStagePPGroup):
        self._base = base
        self.pp = pp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def _chunks(modules: Any) -> list[torch.nn.Module]:
    return list(modules) if isinstance(modules, (list, tuple)) else [modules]


def _model_bridge(bridge: Any) -> Any:
    """The bridge's per-architecture MegatronModelBridge (a fresh instance: its caches are ours alone)."""
    try:
        return bridge._model_bridge
    except AttributeError:
        raise ExportError(
            f"{type(bridge).__name__} is not a Megatron-Bridge AutoBridge; the PP-local export needs "
            "megatron.bridge.AutoBridge (verl: actor.megatron.use_mbridge=True, vanilla_mbridge=False)"
        ) from None


def choose_export_mode(modules: Any, bridge: Any) -> ModeChoice:
    """`pp_local` unless the model or bridge needs the full export path (FP8, QAT, LoRA merge)."""
    if getattr(bridge, "export_weight_dtype", None) == "fp8":
        return ModeChoice("filter_full", "bridge.export_weight_dtype='fp8' builds blockwise-FP8 export tasks")
    from megatron.core.fp8_utils import is_float8tensor

    mb = _model_bridge(bridge)
    for chunk in _chunks(modules):
        for name, module in chunk.named_modules():
            if name.endswith("_quantizer") or type(module).__name__.endswith("TensorQuantizer"):
                return ModeChoice("filter_full", f"QAT/ModelOpt quantizer {name!r}: quantized export postprocessing")
        for name, param in chunk.named_parameters():
            if is_float8tensor(param):
                return ModeChoice("filter_full", f"FP8 parameter {name!r}")
            if mb._is_adapter_param_name(name):
                return ModeChoice("filter_full", f"LoRA adapter parameter {name!r}: merging gathers adapters")
    return ModeChoice("pp_local", "stage-local tasks with single-stage pipeline groups")


def _stage_global_names(mb: Any, chunks: list[torch.nn.Module]) -> list[str]:
    """This stage's global Megatron names, in the bridge's global order, found without any collective.

    Megatron-Bridge gathers these over the pipeline group; each stage's own share is what it computes locally.
    """
    from megatron.bridge.models.conversion.model_bridge import _megatron_local_name_to_global
    from megatron.bridge.models.conversion.utils import extract_sort_key, persistent_buffers

    config = chunks[0].config
    names: set[str] = set()
    for vp_stage, chunk in enumerate(chunks):
        for local_name, _ in itertools.chain(chunk.named_parameters(), persistent_buffers(chunk)):
            if "_extra_state" in local_name:
                continue
            global_name = _megatron_local_name_to_global(chunks, config, mb._unwrap_name(local_name), vp_stage)
            if not mb._is_adapter_param_name(global_name):
                names.add(global_name)
    return sorted(names, key=extract_sort_key)


def _stage_tasks(mb: Any, hf_pretrained: Any, modules: Any, weight_dtype: torch.dtype | None) -> list[Any]:
    """The bridge's conversion tasks of this stage's parameters only (MTP embedding duplicates dropped)."""
    from megatron.bridge.models.conversion.utils import unwrap_model

    chunks = _chunks(modules)
    unwrapped = unwrap_model(chunks)
    missing = object()
    saved = mb.__dict__.get("_cached_param_names", missing)
    mb._cached_param_names = _stage_global_names(mb, unwrapped)  # the bridge's cache: skips its PP gather
    try:
        tasks = mb.build_conversion_tasks(hf_pretrained, unwrapped, weight_dtype=weight_dtype)
    finally:
        if saved is missing:
            del mb._cached_param_names
        else:
            mb._cached_param_names = saved
    # An MTP block on the last stage holds a copy of the embedding: stage 0 exports it (the full export treats
    # that copy as a broadcast receiver), so exporting it here too would send it twice.
    return [
        t
        for t in tasks
        if t is not None
        and t.param_weight is not None
        and not mb._should_skip_mtp_duplicate_embedding_export(t, chunks)
    ]


def _warm_auto_mapping(mapping: Any, module: torch.nn.Module) -> None:
    """Create an AutoMapping's lazy delegate now, so the copy below reaches (and rewires) it."""
    if hasattr(type(mapping), "_detect_parallelism_type") and mapping.__dict__.get("_mapping", False) is None:
        kind = mapping._detect_parallelism_type(module)
        mapping._mapping = mapping._get_or_create_mapping(kind)
        mapping._detected_type = kind


def stage_local_mapping(mapping: Any, module: torch.nn.Module, pp: _SingleStagePPGroup | None = None) -> Any:
    """A recursive copy of a bridge mapping whose pipeline group is the single-stage stand-in.

    TP/EP/ETP groups stay the real ones, so in-stage gathers happen; the original mapping is not touched.
    """
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    pp = pp or _SingleStagePPGroup()
    local = copy.copy(mapping)
    if isinstance(local, MegatronParamMapping):
        local.pp_group = pp
        if getattr(local, "_pg_collection", None) is not None:
            local._pg_collection = _PGCollectionWithStagePP(local._pg_collection, pp)
        local._broadcast_obj_cache = {}
        local._tensor_spec_output_cache = {}
        _warm_auto_mapping(local, module)
    for attr, value in list(vars(local).items()):
        if isinstance(value, MegatronParamMapping) or "_base_mapping" in getattr(value, "__dict__", {}):
            setattr(local, attr, stage_local_mapping(value, module, pp))
    return local


@dataclass(frozen=True)
class StageOwnership:
    """Which HF names of the full export belong to this stage (the fallback's filter)."""

    names: frozenset[str]
    layer_prefixes: frozenset[str]
    claims_unowned: bool  # pp rank 0 keeps names no stage claims, so the fallback never drops a tensor
    claimed_elsewhere: frozenset[str] = frozenset()
    prefixes_elsewhere: frozenset[str] = frozenset()

    def owns(self, hf_name: str) -> bool:
        prefix = _layer_prefix(hf_name)
        if hf_name in self.names or (prefix is not None and prefix in self.layer_prefixes):
            return True
        if hf_name in self.claimed_elsewhere or (prefix is not None and prefix in self.prefixes_elsewhere):
            return False
        return self.claims_unowned


def _layer_prefix(hf_name: str) -> str | None:
    match = _LAYER_PREFIX.match(hf_name)
    return match.group(1) if match else None


def _task_hf_names(mb: Any, task: Any, tied_registry: Any) -> set[str]:
    hf = task.mapping.hf_param
    names = {hf} if isinstance(hf, str) else set(hf.values())
    if tied_registry is not None:
        alias = mb._get_tied_output_hf_name(task, tied_registry)
        if alias:
            names.add(alias)
    return names


class StageExporter:
    """This PP stage's HF export, planned once and run every sync.

    `modules`: this rank's Megatron model chunks (one per VPP stage, wrapped or not); `bridge`: the AutoBridge.
    `full_export`: the stream the fallback filters (default: `bridge.export_hf_weights`); verl's engine passes
    its own `get_per_tensor_param` so its FP8/QAT handling applies. `reason`: why an explicit mode was chosen
    (logged with the fallback).
    """

    def __init__(
        self,
        modules: Any,
        bridge: Any,
        *,
        mode: ExportMode = "auto",
        weight_dtype: torch.dtype | None = None,
        full_export: Callable[[], Iterable[Any]] | None = None,
        reason: str | None = None,
    ):
        if mode not in ("auto", "pp_local", "filter_full"):
            raise ValueError(f"export mode must be 'auto', 'pp_local' or 'filter_full', not {mode!r}")
        self.modules = _chunks(modules)
        self.bridge = bridge
        self.weight_dtype = weight_dtype
        self._full_export = full_export
        self._mb = _model_bridge(bridge)
        if mode == "auto":
            self.choice = choose_export_mode(self.modules, bridge)
        else:
            self.choice = ModeChoice(mode, reason or "requested explicitly")
        if self.choice.mode == "filter_full":
            logger.warning("p2p export: filtering the full export by stage (%s)", self.choice.reason)
        self._tasks: list[Any] | None = None
        self._ownership: StageOwnership | None = None

    @property
    def mode(self) -> str:
        return self.choice.mode

    def stage_tasks(self) -> list[Any]:
        """This stage's conversion tasks with stage-local mappings (built once; no collective)."""
        if self._tasks is None:
            tasks = _stage_tasks(self._mb, self.bridge.hf_pretrained, self.modules, self.weight_dtype)
            pp = _SingleStagePPGroup()
            self._tasks = [
                dataclasses.replace(t, mapping=stage_local_mapping(t.mapping, t.megatron_module, pp)) for t in tasks
            ]
        return self._tasks

    def ownership(self, exchange: bool = True) -> StageOwnership:
        """This stage's HF names; with `exchange`, one all_gather_object over the PP group learns the others'.

        Every stage reaches the exchange even when listing its own names failed (it sends the error instead),
        so a failure on one stage raises on every stage rather than leaving the others in the gather.
        """
        if self._ownership is None:
            from megatron.core import parallel_state as mpu

            pp_rank, pp_size = mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()
            names: set[str] = set()
            prefixes: set[str] = set()
            error: Exception | None = None
            try:
                names, prefixes = self._own_hf_names()
            except Exception as exc:  # sent to the other stages below, then raised
                error = exc
            others_names: set[str] = set()
            others_prefixes: set[str] = set()
            if exchange and pp_size > 1:
                gathered: list[Any] = [None] * pp_size
                mine = (sorted(names), sorted(prefixes)) if error is None else f"{type(error).__name__}: {error}"
                torch.distributed.all_gather_object(gathered, mine, group=mpu.get_pipeline_model_parallel_group())
                failed = {rank: why for rank, why in enumerate(gathered) if isinstance(why, str)}
                if failed:
                    raise ExportError(
                        "pipeline stage(s) could not list the HF tensors they export: "
                        + "; ".join(f"stage {rank}: {why}" for rank, why in sorted(failed.items()))
                    ) from error
                for rank, (n, p) in enumerate(gathered):
                    if rank != pp_rank:
                        others_names.update(n)
                        others_prefixes.update(p)
            elif error is not None:
                raise error
            self._ownership = StageOwnership(
                frozenset(names), frozenset(prefixes), pp_rank == 0, frozenset(others_names), frozenset(others_prefixes)
            )
        return self._ownership

    def _own_hf_names(self) -> tuple[set[str], set[str]]:
        """The HF names of this stage's conversion tasks and their layer prefixes (no collective)."""
        from megatron.bridge.models.conversion.utils import unwrap_model

        config = unwrap_model(self.modules)[0].config
        tied = self._mb.mapping_registry() if self._mb._share_embeddings_and_output_weights(config) else None
        names: set[str] = set()
        for task in _stage_tasks(self._mb, self.bridge.hf_pretrained, self.modules, self.weight_dtype):
            names |= _task_hf_names(self._mb, task, tied)
        return names, {p for p in map(_layer_prefix, names) if p is not None}

    def export(self, *, cpu: bool = False) -> Iterator[HFTensor]:
        """This stage's `(global HF name, tensor)` stream; every rank of the stage must iterate it fully."""
        if self.choice.mode == "pp_local":
            yield from self._export_pp_local(cpu)
        else:
            yield from self._export_filtered(cpu)

    def _export_pp_local(self, cpu: bool) -> Iterator[HFTensor]:
        stream = self._mb.stream_weights_megatron_to_hf(
            self.modules,
            self.bridge.hf_pretrained,
            cpu=cpu,
            show_progress=False,
            conversion_tasks=self.stage_tasks(),
            merge_adapter_weights=False,
        )
        for weight in stream:  # HFWeightTuple -> plain (name, tensor)
            yield weight.param_name, weight.weight

    def _export_filtered(self, cpu: bool) -> Iterator[HFTensor]:
        owned = self.ownership()
        if self._full_export is not None:
            stream = self._full_export()
        else:
            stream = self.bridge.export_hf_weights(self.modules, cpu=cpu, show_progress=False)
        for name, tensor in stream:
            if owned.owns(name):
                yield name, (tensor.cpu() if cpu else tensor)


def export_local_hf(
    modules: Sequence[torch.nn.Module] | torch.nn.Module,
    bridge: Any,
    *,
    mode: ExportMode = "auto",
    cpu: bool = False,
    weight_dtype: torch.dtype | None = None,
) -> Iterator[HFTensor]:
    """This PP stage's `(global HF name, tensor)` pairs, once. For repeated syncs keep a `StageExporter`.

    Every rank of the stage must iterate to the end (TP/EP gathers are collectives); in `filter_full` mode every
    rank of the model must (the full export broadcasts across stages).
    """
    yield from StageExporter(modules, bridge, mode=mode, weight_dtype=weight_dtype).export(cpu=cpu)

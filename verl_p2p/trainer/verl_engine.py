"""Reach verl 0.9.1's training engine from the actor worker, pick its export, and wrap its checkpoint save.

Two engines are sources (`trainer/exports.py`): the Megatron engine (PP-local stage export) and the FSDP / FSDP2
engine (`FSDPEngineWithLMHead`: verl's full-tensor stream, `trainer/fsdp_export.py`). `find_training_engine`
returns either; `engine_exporter` builds the export that fits it.

Where the engine lives (verl 0.9.1, `verl/workers/engine_workers.py`):

    ActorRolloutRefWorker (and subclasses: DetachActorWorker, ...)
      .checkpoint_engine   our P2PCheckpointEngine (built in init_model by CheckpointEngineRegistry.new)
      .actor               TrainingWorker
        .engine            MegatronEngine (verl/workers/engine/megatron/transformer_impl.py)
          .module          list of Megatron model chunks (one per VPP stage)
          .bridge          megatron.bridge AutoBridge
        .engine            or FSDPEngineWithLMHead (verl/workers/engine/fsdp/transformer_impl.py)
          .module          the FSDP / FSDP2-wrapped HF model

The worker never hands itself to the checkpoint engine: for backends other than `naive`/`delta_sharded`,
`update_weights` calls `send_weights(per_tensor_param)` with a full-export generator, which the p2p engine
must not iterate for Megatron (it would broadcast the whole model to every stage); for FSDP it is the stream
itself, consumed once (`export_engine_stage`). So, without patching verl, the p2p
engine finds its worker as the object holding it in its `checkpoint_engine` attribute (`find_owning_worker`,
a garbage-collector referrer lookup done once and cached by the caller), then the engine by the path above.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from verl_p2p.errors import P2PError
from verl_p2p.trainer.export import ExportMode, ModeChoice, StageExporter, choose_export_mode
from verl_p2p.trainer.fsdp_export import FullStreamExport, is_fsdp_engine, refuse_export_mode

ENGINE_PATH = "worker.actor.engine"

logger = logging.getLogger(__name__)


class EngineAccessError(P2PError):
    """verl's training engine could not be found where verl 0.9.1 keeps it."""


def _is_megatron_engine(obj: Any) -> bool:
    try:
        from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    except ImportError:  # megatron not installed: nothing can be a MegatronEngine
        return False
    return isinstance(obj, MegatronEngine)


def find_megatron_engine(worker: Any) -> Any:
    """verl's MegatronEngine of an actor worker (`worker.actor.engine`), a TrainingWorker (`worker.engine`),
    or the engine itself. Raises `EngineAccessError` naming what was found instead."""
    if _is_megatron_engine(worker):
        return worker
    if hasattr(worker, "actor"):  # ActorRolloutRefWorker: `actor` is None until init_model()
        candidate = getattr(worker.actor, "engine", None)
        where = f"{type(worker).__name__}.actor.engine"
    else:  # TrainingWorker
        candidate = getattr(worker, "engine", None)
        where = f"{type(worker).__name__}.engine"
    if candidate is None:
        raise EngineAccessError(
            f"no training engine at {where} (expected verl 0.9.1's {ENGINE_PATH}); is this the actor worker, and "
            "has init_model() run? p2p needs verl's new engine workers (use_legacy_worker_impl=disable)"
        )
    if not _is_megatron_engine(candidate):
        raise EngineAccessError(
            f"{where} is a {type(candidate).__name__}, not verl's MegatronEngine: the p2p backend's PP-local "
            "export needs the Megatron trainer (actor.strategy=megatron)"
        )
    return candidate


def find_training_engine(worker: Any) -> Any:
    """verl's FSDP engine or Megatron engine of an actor worker, a TrainingWorker, or the engine itself; any
    other engine is refused by `find_megatron_engine`'s error, which also names the FSDP strategies."""
    if is_fsdp_engine(worker):
        return worker
    holder = getattr(worker, "actor", None) if hasattr(worker, "actor") else worker
    candidate = getattr(holder, "engine", None)
    if is_fsdp_engine(candidate):
        return candidate
    try:
        return find_megatron_engine(worker)
    except EngineAccessError as exc:
        if candidate is None:
            raise
        raise EngineAccessError(
            f"{exc}; or verl's FSDP engine (actor.strategy=fsdp or fsdp2, FSDPEngineWithLMHead), whose "
            "full-tensor stream the p2p source also takes"
        ) from None


def find_owning_worker(checkpoint_engine: Any) -> Any:
    """The verl worker whose `checkpoint_engine` attribute is `checkpoint_engine` (a gc referrer lookup).

    Call once per process and keep the answer: it walks the referrers of one object, not the whole heap.
    """
    for referrer in gc.get_referrers(checkpoint_engine):
        if getattr(referrer, "checkpoint_engine", None) is checkpoint_engine and hasattr(referrer, "actor"):
            return referrer
        if isinstance(referrer, dict) and referrer.get("checkpoint_engine") is checkpoint_engine:
            for owner in gc.get_referrers(referrer):
                if getattr(owner, "__dict__", None) is referrer and hasattr(owner, "actor"):
                    return owner
    raise EngineAccessError(
        f"no verl worker holds this {type(checkpoint_engine).__name__} as its `checkpoint_engine` attribute; "
        "p2p's trainer side must run inside verl's ActorRolloutRefWorker"
    )


def engine_mode_choice(engine: Any) -> ModeChoice:
    """The export path for a verl Megatron engine: its QAT / LoRA / FP8 settings force the filtered fallback."""
    if getattr(engine, "vanilla_bridge", False):
        raise EngineAccessError(
            "verl's vanilla mbridge (actor.megatron.vanilla_mbridge=True) cannot export per stage: "
            "use Megatron-Bridge (vanilla_mbridge=False)"
        )
    if getattr(engine, "_qat_enabled", False):
        return ModeChoice("filter_full", "QAT enabled: verl post-processes the full export (export_qat_weights)")
    if getattr(engine, "peft_cls", None) is not None:
        return ModeChoice("filter_full", "LoRA: verl's export merges or separates adapters")
    return choose_export_mode(engine.module, engine.bridge)


def engine_exporter(engine: Any, *, mode: ExportMode = "auto") -> StageExporter | FullStreamExport:
    """The export of `engine`: FSDP's full-tensor stream (refusing what it cannot serve), or a `StageExporter`
    over the Megatron engine's chunks and bridge (its fallback filters verl's own full export)."""
    if is_fsdp_engine(engine):
        refuse_export_mode(mode)
        return FullStreamExport(engine)
    choice = engine_mode_choice(engine) if mode == "auto" else ModeChoice(mode, "requested explicitly")

    def full_export() -> Any:
        return engine.get_per_tensor_param()[0]

    return StageExporter(engine.module, engine.bridge, mode=choice.mode, reason=choice.reason, full_export=full_export)


def export_peers(engine: Any, *, mode: ExportMode = "auto") -> tuple[int, ...] | None:
    """The global ranks this rank's export runs collectives with: for Megatron's PP-local export, its tensor-,
    expert- and expert-tensor-parallel groups (Megatron-Bridge's mappings gather over exactly those, within the
    stage); None (every rank) for FSDP's gathers and the full export, or when the groups cannot be read."""
    if is_fsdp_engine(engine):
        return None
    try:
        chosen = engine_mode_choice(engine).mode if mode == "auto" else mode
        if chosen != "pp_local":
            return None
        from megatron.core import parallel_state as mpu

        groups = (
            mpu.get_tensor_model_parallel_group(),
            mpu.get_expert_model_parallel_group(),
            mpu.get_expert_tensor_parallel_group(),
        )
        ranks = {torch.distributed.get_rank()}
        for group in groups:
            if group is not None:
                ranks.update(torch.distributed.get_process_group_ranks(group))
        return tuple(sorted(ranks))
    except Exception as exc:  # noqa: BLE001 - every rank: a re-push around a dead rank then fails, named
        logger.warning("p2p: could not read the export's process groups (%s): planning with every rank", exc)
        return None


def export_engine_stage(
    exporter: StageExporter | FullStreamExport,
    engine: Any,
    *,
    cpu: bool = False,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Run one sync's export; Megatron's offloaded parameters are loaded to the GPU first, as verl's export does
    (FSDP's stream handles its own offload).

    `weights`: the generator verl's worker handed to `send_weights` for this sync. FSDP's export consumes it (one
    stream per sync); Megatron's never iterates it (a full export: every stage broadcast to every rank)."""
    if isinstance(exporter, FullStreamExport):
        yield from exporter.export(cpu=cpu, weights=weights)
        return
    if exporter.mode == "pp_local" and getattr(engine, "is_param_offload_enabled", False):
        from verl.utils.megatron_utils import load_megatron_model_to_gpu

        load_megatron_model_to_gpu(engine.module, load_grad=False)
    yield from exporter.export(cpu=cpu)


# ------------------------------------------------------------------------------------------ checkpoint saves


class ReleasableBuffers(Protocol):
    """What the save hook needs of the transfer buffers (verl_p2p.transfer.buffers.TransferBuffers)."""

    def release(self) -> None: ...

    def restore(self) -> None: ...


_MISSING = object()


@dataclass
class SaveHook:
    """An installed save wrapper on one engine instance; `remove()` puts back what the instance had before."""

    engine: Any
    buffers: ReleasableBuffers
    previous: Any = _MISSING  # the instance's own `save_checkpoint` attribute before the hook, if it had one

    def remove(self) -> None:
        current = self.engine.__dict__.get("save_checkpoint")
        if getattr(current, "__p2p_save_hook__", None) is not self:
            return
        if self.previous is _MISSING:
            del self.engine.__dict__["save_checkpoint"]
        else:
            self.engine.__dict__["save_checkpoint"] = self.previous


def release_buffers_around_save(engine: Any, buffers: ReleasableBuffers) -> SaveHook:
    """Wrap this engine's `save_checkpoint` (an instance attribute; the class is untouched) so the transfer
    buffers are released (unregistered, freed) before verl saves and restored afterwards, even if it raises.

    A save stages optimizer and model state in host memory; the pinned transfer buffers would compete with it.
    Installing again replaces the earlier hook (one wrapper, the latest buffers).
    """
    existing = engine.__dict__.get("save_checkpoint")
    if existing is not None and hasattr(existing, "__p2p_save_hook__"):
        existing.__p2p_save_hook__.remove()
    hook = SaveHook(engine, buffers, engine.__dict__.get("save_checkpoint", _MISSING))
    original: Callable[..., Any] = engine.save_checkpoint

    @functools.wraps(original)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        buffers.release()
        logger.info("p2p: transfer buffers released for save_checkpoint")
        try:
            return original(*args, **kwargs)
        finally:
            buffers.restore()
            logger.info("p2p: transfer buffers restored after save_checkpoint")

    save_checkpoint.__p2p_save_hook__ = hook  # type: ignore[attr-defined]
    engine.save_checkpoint = save_checkpoint
    return hook

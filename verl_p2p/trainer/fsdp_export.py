"""The full-tensor export of verl's FSDP / FSDP2 engine: verl's own `get_per_tensor_param()` stream.

verl 0.9.1's `FSDPEngineWithLMHead.get_per_tensor_param()` yields every HF tensor of the model, whole, on every
rank, in the same order (each DTensor's `full_tensor()` is an all-gather: every rank of the FSDP mesh must iterate
it in step). So there is no stage to keep local: every rank holds the full model tensor by tensor, and writes
only its byte-balanced part of every target (`planning.fsdp.build_full_stream_plan`). The stream is the generator
verl's worker made for this sync and handed to `send_weights` (one stream per sync: a second call would stage the
model twice), consumed one tensor at a time; offload stays as verl's generator handles it. FSDP1
(`FullyShardedDataParallel`, `strategy=fsdp`) and FSDP2 (`fully_shard`, `strategy=fsdp2`) stream alike.

What this export cannot serve is refused before anything is launched or written: an unmerged LoRA (the stream
yields adapters, not weights), QAT (the stream yields packed quantized tensors), a stream whose names the rollout
does not take (`check_stream`), and ranks whose streams would differ (`manifest_digest`, compared by the
go/no-go in `senders.agree_to_export`).
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl_p2p.errors import P2PConfigError, P2PError

HFTensor = tuple[str, torch.Tensor]
FULL_STREAM = "full_stream"


class FullStreamRefusedError(P2PError):
    """The FSDP engine's stream cannot be served by p2p as configured (the message names the fix)."""


@dataclass(frozen=True)
class StreamEntry:
    """One tensor of the stream as predicted before it runs: HF name, full shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def is_fsdp_engine(obj: Any) -> bool:
    """Whether `obj` is verl's FSDP engine (FSDP1 or FSDP2, `FSDPEngine` and its LM-head subclass)."""
    try:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
    except ImportError:
        return False
    return isinstance(obj, FSDPEngine)


def _peft_model(engine: Any) -> Any:
    return getattr(engine.module, "_fsdp_wrapped_module", engine.module)


def has_lora(engine: Any) -> bool:
    return hasattr(_peft_model(engine), "peft_config")


def lora_merged(engine: Any) -> bool:
    lora = getattr(engine.model_config, "lora", None) or {}
    return bool(lora.get("merge", False))


def refuse_unservable(engine: Any) -> None:
    """Refuse what the full stream cannot serve, before anything is launched (names the fix)."""
    if has_lora(engine) and not lora_merged(engine):
        raise FullStreamRefusedError(
            "the FSDP actor trains a LoRA adapter that is not merged: verl's get_per_tensor_param() then streams "
            "the adapter tensors (lora_A/lora_B) for a rollout that loads adapters, while p2p writes full weights "
            "into the rollout's own parameters. Fix: set actor_rollout_ref.model.lora.merge=True (verl merges the "
            "adapter into the streamed weights), or use another checkpoint-engine backend for adapter syncs"
        )
    if getattr(engine, "_qat_enabled", False):
        raise FullStreamRefusedError(
            "the FSDP actor has QAT enabled: verl's stream then yields packed quantized tensors that p2p's write "
            "plans (built from the rollout's checkpoint) do not take. Fix: disable QAT for p2p syncs, or use "
            "verl's own checkpoint-engine backend for QAT rollouts"
        )


class FullStreamExport:
    """verl's FSDP engine as a p2p export: every rank iterates verl's stream in step (`mode` 'full_stream').

    `export_ranks` of the session is then every rank (the gathers span the whole FSDP mesh), and `drive_export`
    drains the stream on ranks without targets so their collectives still match."""

    mode = FULL_STREAM

    def __init__(self, engine: Any, reason: str = "verl's FSDP engine streams full tensors on every rank"):
        refuse_unservable(engine)
        self.engine = engine
        self.reason = reason
        self._manifest: tuple[StreamEntry, ...] | None = None

    def export(self, *, cpu: bool = False, weights: Iterable[HFTensor] | None = None) -> Iterator[HFTensor]:
        """verl's own stream, tensor by tensor (nothing collected); every rank must iterate it to the end.

        `weights`: the `get_per_tensor_param()` generator verl's worker already made for this sync and handed to
        `send_weights`; consumed as is, so the model is staged (FSDP1 / LoRA: loaded to the GPU and offloaded)
        once per sync. Only a caller without verl's generator (a direct `SourceSession.push()`) makes one here.
        A tied LM head is dropped (`tied_duplicates`): verl gathers it, but it is the embedding."""
        stream = weights if weights is not None else self.engine.get_per_tensor_param()[0]
        dropped = tied_duplicates(self.engine)
        for name, tensor in stream:
            if name in dropped:
                continue
            yield name, (tensor.cpu() if cpu else tensor)

    def manifest(self) -> tuple[StreamEntry, ...]:
        """The stream's names, full shapes and dtypes, predicted without a collective (cached)."""
        if self._manifest is None:
            self._manifest = predict_stream(self.engine)
        return self._manifest

    def manifest_digest(self) -> str:
        return digest_of(self.manifest())

    def check_stream(self, groups: Sequence[Any], allowed_unused: Sequence[str] = ()) -> None:
        """Refuse, before any write, a stream the targets' write plans do not match (see `check_stream`)."""
        check_stream(self.manifest(), groups, allowed_unused)


def predict_stream(engine: Any) -> tuple[StreamEntry, ...]:
    """What `get_per_tensor_param()` will yield, from the module's state dict (DTensors carry the full shape)
    run through verl's own renaming (`convert_weight_keys`) and MoE unfusing on meta tensors: no gather."""
    from verl.utils.model import convert_weight_keys
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    params = _state_dict(engine)
    if has_lora(engine):  # merged LoRA (unmerged is refused): verl streams the base names
        from verl.utils.fsdp_utils import normalize_peft_param_name

        params = normalize_peft_param_name(params)
    params = convert_weight_keys(params, _peft_model(engine))
    meta = ((n, torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")) for n, t in params.items())
    model_type = getattr(engine.model_config.hf_config, "model_type", None)
    dropped = tied_duplicates(engine)
    return tuple(
        StreamEntry(n, tuple(t.shape), t.dtype) for n, t in unfuse_moe_params(meta, model_type) if n not in dropped
    )


def _state_dict(engine: Any) -> dict[str, Any]:
    """The module's state dict as verl takes it: FSDP2's only collects DTensor references; FSDP1's runs its unshard
    machinery on flat params that must be on the device, so offloaded ones are loaded first and offloaded again
    after (verl's own `get_per_tensor_param_shard` staging). Called once per export (the manifest is cached)."""
    from verl.utils.fsdp_utils import fsdp_version, load_fsdp_model_to_gpu, offload_fsdp_model_to_cpu

    staged = fsdp_version(engine.module) == 1 and getattr(engine, "_is_offload_param", False)
    if staged:
        load_fsdp_model_to_gpu(engine.module)
    try:
        return engine.module.state_dict()
    finally:
        if staged:
            offload_fsdp_model_to_cpu(engine.module)


def tied_duplicates(engine: Any) -> frozenset[str]:
    """Streamed names that are another tensor under a second name: with `tie_word_embeddings` the HF model's
    state dict (so verl's stream) carries `lm_head.weight`, the embedding itself, which a tied checkpoint does
    not store and SGLang's loaders skip (the rollout ties the two)."""
    hf_config = engine.model_config.hf_config
    tied = hf_config.get("tie_word_embeddings") if isinstance(hf_config, Mapping) else None
    if tied is None:
        tied = getattr(hf_config, "tie_word_embeddings", False)
    return frozenset({"lm_head.weight"}) if tied else frozenset()


def digest_of(entries: Iterable[StreamEntry]) -> str:
    """A short digest of the stream's order, names, shapes and dtypes (equal streams, equal digests)."""
    h = hashlib.sha256()
    for e in entries:
        h.update(f"{e.name}|{list(e.shape)}|{e.dtype}\n".encode())
    return h.hexdigest()[:16]


def check_stream(entries: Sequence[StreamEntry], groups: Sequence[Any], allowed_unused: Sequence[str] = ()) -> None:
    """Refuse a stream the rollout does not take, naming the tensors and the fix. Against the checkpoint specs
    the targets' write plans were built from (`plan.hf_specs`): a streamed name no plan knows (unless allowed),
    a shape that differs, and an HF tensor a rollout parameter of this rank's part needs that is never streamed."""
    planned: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for g in groups:
        planned.update(getattr(g.replica.plan, "hf_specs", None) or {})
    streamed = {e.name: e for e in entries}
    unknown = [
        e.name
        for e in entries
        if e.name not in planned and not any(fnmatch.fnmatchcase(e.name, p) for p in allowed_unused)
    ]
    if unknown:
        raise FullStreamRefusedError(
            f"the FSDP actor streams {len(unknown)} HF tensor(s) the rollout's checkpoint does not have "
            f"({unknown[:5]}{' ...' if len(unknown) > 5 else ''}): no rollout parameter takes them, so their "
            "updates would be lost. Fix: serve the rollout from the checkpoint the actor was built from "
            "(same architecture and config), or, if the rollout has no use for them, allow them with a matching "
            "pattern in engine_kwargs.verl_p2p.unused_hf_tensors_allowed"
        )
    mismatched = [
        f"{n} streams {list(e.shape)}, the rollout's checkpoint has {list(planned[n][0])}"
        for n, e in streamed.items()
        if n in planned and tuple(e.shape) != tuple(planned[n][0])
    ]
    if mismatched:
        raise FullStreamRefusedError(
            f"the FSDP actor and the rollout disagree on tensor shapes ({'; '.join(mismatched[:3])}): they were "
            "built from different model configs. Fix: start both from the same checkpoint / override config"
        )
    needed = _needed_feeds(groups)
    missing = sorted(set(needed) - set(streamed))
    if missing:
        shown = [f"{n} (for {needed[n]})" for n in missing[:5]]
        raise FullStreamRefusedError(
            f"the FSDP actor's stream lacks {len(missing)} HF tensor(s) rollout parameters need ({shown}"
            f"{' ...' if len(missing) > 5 else ''}): those parameters would never be written. Fix: check the "
            "actor's model is the rollout's architecture (model path, override config, tied embeddings)"
        )


def _needed_feeds(groups: Sequence[Any]) -> dict[str, str]:
    """HF name -> one rollout parameter of the groups (this rank's part) that needs it."""
    needed: dict[str, str] = {}
    for g in groups:
        params: Mapping[str, Any] = g.params
        for pname, p in params.items():
            for feed in p.feeds:
                needed.setdefault(feed, pname)
    return needed


def refuse_export_mode(mode: str) -> None:
    """`export_mode` chooses among the Megatron exports; for the FSDP engine only 'auto' means something."""
    if mode != "auto":
        raise P2PConfigError(
            f"engine_kwargs.verl_p2p.export_mode={mode!r} selects a Megatron export, but the actor is verl's FSDP "
            "engine (actor.strategy=fsdp/fsdp2), whose full-tensor stream is the only export: set export_mode=auto"
        )

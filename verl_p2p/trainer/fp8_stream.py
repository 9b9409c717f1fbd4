"""The quantize step of an FP8 sync: the trainer's bf16 HF stream -> the block-FP8 tensors the rollout loaded.

Which tensors: exactly those the rollout's checkpoint stores as e4m3fn with a `weight_scale_inv` beside it (the
write plans' HF specs come from its safetensors headers). Each such tensor is quantized on its own device by
`verl_p2p.quant.block_fp8` and replaced in the stream by its FP8 bytes and its scales; every other tensor passes
unchanged. Tensors of one shape that arrive together (a layer's experts) are quantized in one batched call.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from verl_p2p.errors import QuantizationError
from verl_p2p.quant.block_fp8 import BLOCK, FLOAT_INPUTS, quantize_many, raise_if_nonfinite, scale_name

PlannedSpecs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def fp8_targets(planned: PlannedSpecs) -> dict[str, str]:
    """HF weight name -> its scale name, for every planned e4m3fn weight; refuses a planned FP8 weight whose
    scales are missing or not 128x128 blocks (a checkpoint the quantizer cannot reproduce)."""
    out: dict[str, str] = {}
    fp8, fp32 = torch.float8_e4m3fn, torch.float32
    blocks: dict[tuple[int, ...], tuple[int, ...]] = {}  # weight shape -> its scales' shape (a model has few shapes)
    for name, (shape, dtype) in planned.items():  # once per push, over every planned tensor: kept lean
        if dtype != fp8 or not name.endswith("weight"):
            continue
        scale = scale_name(name)
        want = blocks.get(shape)
        if want is None:
            want = blocks[shape] = tuple(-(-d // b) for d, b in zip(shape[-2:], BLOCK, strict=True))
        got = planned.get(scale)
        if got is None or got[1] != fp32 or tuple(got[0][-2:]) != want:
            raise QuantizationError(
                f"the rollout's checkpoint stores {name!r} {tuple(shape)} as float8_e4m3fn with scales "
                f"{scale!r}={got}, not fp32 {want} (one per 128x128 block): the trainer's quantizer cannot "
                "reproduce it; write the checkpoint with verl_p2p.trainer.fp8_checkpoint"
            )
        out[name] = scale
    return out


# id(write plan) -> (the plan, its targets). Process-wide on purpose: a memo of a pure function of an immutable
# plan, dropped with the plan (weakref.finalize); the plan's owners (a session's executors, the bench, the source's
# pre-pause compile) all ask for the same answer, so one memo serves them without threading it through each.
_PLAN_TARGETS: dict[int, tuple[weakref.ref, dict[str, str]]] = {}


def plan_fp8_targets(plans: Iterable[Any]) -> dict[str, str]:
    """`fp8_targets` of the write plans' HF specs, together, computed once per plan object (a plan is immutable
    and lives across syncs; every push asks again). Plans that take no weak reference are walked each time."""
    out: dict[str, str] = {}
    for plan in plans:
        specs = getattr(plan, "hf_specs", None) or {}
        hit = _PLAN_TARGETS.get(id(plan))
        if hit is None or hit[0]() is not plan:
            try:
                ref = weakref.ref(plan)
            except TypeError:
                out.update(fp8_targets(specs))
                continue
            hit = _PLAN_TARGETS[id(plan)] = (ref, fp8_targets(specs))
            weakref.finalize(plan, _PLAN_TARGETS.pop, id(plan), None)
        out.update(hit[1])
    return out


def quantized_stream(
    stream: Iterable[tuple[str, torch.Tensor]],
    planned: PlannedSpecs,
    batch: int = 256,
    batch_bytes: int = 1 << 29,
    targets: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`stream` with each planned-FP8 weight that arrives in a plain float dtype quantized (weight, then scales).

    The plan is checked here, at the call (before anything streams); `targets` is `fp8_targets(planned)` when the
    caller already has it (push keeps it per plan, `plan_fp8_targets`: it walks every planned tensor, thousands
    for an MoE rank, on the host of every push). Up to `batch` consecutive quantizable
    tensors (at most `batch_bytes` of them) are held and quantized together (fewer kernel launches on a GPU);
    any other tensor flushes the held ones first, so the order of the stream is kept. Nothing in the stream waits
    for the device: a NaN/inf weight is refused, named, when the stream ends, before the push it feeds can
    succeed (the push fails and its targets are left unknown, as for any push failure).
    """
    targets = fp8_targets(planned) if targets is None else targets
    if not targets:
        return iter(stream)
    return _quantized(iter(stream), targets, batch, batch_bytes)


def _quantized(
    stream: Iterator[tuple[str, torch.Tensor]], targets: Mapping[str, str], batch: int, batch_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    held: list[tuple[str, torch.Tensor]] = []
    held_bytes = 0
    nonfinite: list = []  # each batch's NaN/inf counts, on its device: checked once, at the end

    def flush() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal held_bytes
        held_bytes = 0
        results = quantize_many([t for _, t in held], BLOCK, [n for n, _ in held], nonfinite=nonfinite)
        for (name, _), (q, s) in zip(held, results, strict=True):
            yield name, q
            yield targets[name], s
        held.clear()

    for name, tensor in stream:
        if name in targets and tensor.dtype in FLOAT_INPUTS:
            held.append((name, tensor))
            held_bytes += tensor.nbytes
            if len(held) >= batch or held_bytes >= batch_bytes:
                yield from flush()
            continue
        if held:
            yield from flush()
        yield name, tensor
    if held:
        yield from flush()
    raise_if_nonfinite(nonfinite)

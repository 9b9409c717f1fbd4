"""Checks of the HF tensors a trainer streams against the tensors the rollout's write plans were built from.

The plans are built from the checkpoint the rollout loaded (names, shapes, dtypes). A streamed tensor outside
that list reaches no rollout parameter (its update would be lost) unless it is allowed; one of another shape,
or of a dtype SGLang's loader would not have seen there (FP8 without its scales, integers), would be written
as wrong values. Each is refused before anything is loaded from it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence

import torch

from verl_p2p.errors import P2PError

PlannedSpecs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


class StreamRefusedError(P2PError):
    """A streamed HF tensor the rollout cannot take as it is: a name no rollout parameter takes (and not
    allowed), or a dtype/shape other than the one the write plans were built for. Raised before anything is
    loaded from it; the message names the targets whose bytes are unknown (written before it), if any."""


# A change between these is a cast SGLang's own loader makes too (copy_ into the parameter's dtype); any other
# (FP8, integers, bool) carries scales or another meaning the plan's loader path did not see.
PLAIN_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def dtype_compatible(streamed: torch.dtype, planned: torch.dtype) -> bool:
    """Can a tensor of `streamed` dtype go where the plan expects `planned` (same dtype, or a plain float cast)?"""
    return streamed == planned or (streamed in PLAIN_FLOATS and planned in PLAIN_FLOATS)


def refusal(
    planned: PlannedSpecs,
    name: str,
    tensor: torch.Tensor,
    allowed_unused: Sequence[str] = (),
) -> str | None:
    """Why streamed tensor `name` must not be loaded, or None. A name outside `planned` (the checkpoint the
    rollout loaded) reaches no rollout parameter: refused unless it matches an `allowed_unused` pattern."""
    spec = planned.get(name)
    if spec is None:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in allowed_unused):
            return None
        return (
            f"HF tensor {name!r} ({tensor.dtype}, shape {tuple(tensor.shape)}) is not among the {len(planned)} "
            "checkpoint tensors the rollout loaded, so no rollout parameter takes it and its update would be lost. "
            "Fix: make the trainer's export use the checkpoint's tensor names (Megatron-Bridge mapping, "
            "export_mode), or, if the rollout has no use for it, allow it with a matching pattern in "
            "engine_kwargs.<backend>.unused_hf_tensors_allowed"
        )
    shape, dtype = spec
    if tuple(tensor.shape) != tuple(shape):
        return (
            f"HF tensor {name!r} arrives with shape {tuple(tensor.shape)}, the write plans were built for the "
            f"checkpoint's {tuple(shape)}: the trainer and the rollout disagree on the model config"
        )
    if not dtype_compatible(tensor.dtype, dtype):
        what = "FP8 values without their scales" if tensor.dtype in FP8 else f"{tensor.dtype} values"
        return (
            f"HF tensor {name!r} arrives as {tensor.dtype}, the write plans were built for the checkpoint's {dtype}: "
            f"loading it would write {what} into parameters planned for {dtype}. Fix: export in the checkpoint's "
            "dtype (the trainer's params dtype / Megatron-Bridge export_weight_dtype), or serve the rollout from a "
            f"checkpoint in the dtype the trainer exports"
        )
    return None


def check_fp8_export(planned: PlannedSpecs, used: Iterable[str], where: str) -> None:
    """Refuse an FP8 export (Megatron-Bridge export_weight_dtype='fp8') into a plan whose inputs `used` are
    none of them FP8: the weights would be written without their scales. Checked before the first write."""
    if planned and not any(planned[n][1] in FP8 for n in used if n in planned):
        raise StreamRefusedError(
            f"the trainer exports FP8 weights (Megatron-Bridge export_weight_dtype='fp8'), but the write plan of "
            f"{where} takes no FP8 tensor (the rollout loaded a checkpoint without FP8 weights): they would be "
            "written without their scales; nothing was written. Fix: export in the checkpoint's dtype (drop "
            "export_weight_dtype='fp8'), or serve an FP8 checkpoint the rollout loads as FP8"
        )

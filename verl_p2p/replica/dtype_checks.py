"""The floating type a rollout rank holds, checked against the write plan's: a rank publishes only element sizes,
so bfloat16 bytes in a float16 parameter pass every size check; these checks tell the two apart, including what
SGLang's `--dtype auto` resolves to for the checkpoint the rollout serves.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from verl_p2p.errors import ReplicaLoadError
from verl_p2p.replica.plan_types import WritePlan

logger = logging.getLogger(__name__)

_SERVER_DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


def check_plan_dtypes(
    plan: WritePlan, server_args: Mapping[str, Any], hf_config: Mapping[str, Any] | None = None
) -> None:
    """Refuse a plan whose parameters hold another floating type of the server's element size.

    A rank publishes only numel and element size per parameter, so bfloat16 bytes written into a float16
    parameter pass every size check and serve garbage. Parameters of another element size (float32 norms or
    biases in a bfloat16 model, FP8 weights) are told apart by those checks already and are not refused here.
    `dtype=auto`: the checkpoint the rollout serves must resolve it as the plan's config does (`check_auto_dtype`).
    """
    dtype = str(server_args.get("dtype") or "auto")
    if dtype == "auto" and hf_config is not None:
        check_auto_dtype(server_args, hf_config)
    want = _SERVER_DTYPES.get(dtype)
    if want is None:
        return
    wrong = [
        f"{p.name} ({p.dtype})"
        for p in plan.params.values()
        if p.dtype.is_floating_point and p.dtype != want and p.dtype.itemsize == want.itemsize
    ]
    if wrong:
        raise ReplicaLoadError(
            f"the rollout serves dtype={server_args.get('dtype')} ({want}) but the write plan holds "
            f"{len(wrong)} parameter(s) of another {want.itemsize}-byte float type, e.g. {wrong[:3]}: the plan was "
            "made for other server args; rebuild it (or clear plan_cache_dir) from this rollout's /server_info"
        )


def _sglang_auto_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """SGLang's own resolution of `--dtype auto` for a checkpoint config (None where the release lacks it)."""
    try:
        from sglang.srt.configs.model_config import _get_and_verify_dtype
    except ImportError:
        return None
    return _get_and_verify_dtype(dict(config), "auto")


def _auto_inputs(config: Mapping[str, Any]) -> tuple:
    """What SGLang's `auto` rule reads from a config: its dtype field and model type."""
    return (config.get("dtype") or config.get("torch_dtype"), config.get("model_type", ""))


# Rollout model paths already warned about. Process-wide on purpose: the warning is about this host (it cannot read
# the rollout's checkpoint), the same for every session and replica of the process, so it is said once.
_unverified_auto: set[str] = set()


def check_auto_dtype(server_args: Mapping[str, Any], hf_config: Mapping[str, Any]) -> None:
    """A `--dtype auto` rollout holds what SGLang's rule gives for the checkpoint it serves (`model_path`, when this
    host can read it): refused, naming both, when the plan's config resolves it to another type.

    The plan is built from the trainer's copy of the rollout's config (`rollout_model_path`, else the trainer's
    model): a rollout started from another checkpoint (a bfloat16 copy of a float16 one) resolves `auto` to
    another type of the same size, which no size check tells apart. SGLang is imported only when the two configs
    differ in what the rule reads (a cached plan stays SGLang-free otherwise). Where the rollout's path cannot be
    read here, a warning names the risk and the fix (an explicit `--dtype`)."""
    path = server_args.get("model_path")
    config_file = Path(str(path)) / "config.json" if path else None
    if config_file is None or not config_file.is_file():
        if path and str(path) not in _unverified_auto:
            _unverified_auto.add(str(path))
            logger.warning(
                "p2p: the rollout serves dtype=auto from %s, which this host cannot read: its resolved dtype is "
                "assumed to be the plan's; give the rollout an explicit dtype to have it checked",
                path,
            )
        return
    try:
        served = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ReplicaLoadError(f"the rollout's checkpoint config {config_file} cannot be read: {exc}") from exc
    if _auto_inputs(served) == _auto_inputs(hf_config):
        return
    ours, theirs = _sglang_auto_dtype(hf_config), _sglang_auto_dtype(served)
    if ours is not None and theirs is not None and ours != theirs:
        raise ReplicaLoadError(
            f"the rollout serves dtype=auto from {path}, which SGLang resolves to {theirs}, but the write plan's "
            f"checkpoint config resolves it to {ours}: the rollout was started from another checkpoint than the one "
            "the trainer plans from; set rollout_model_path to the checkpoint the rollout serves, or launch the "
            "rollout with an explicit dtype"
        )

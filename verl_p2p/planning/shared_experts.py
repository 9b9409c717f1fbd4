"""Shared-experts fusion as the rollout decided it, never as the trainer's device would.

SGLang may fold a MoE layer's shared expert into routed slot E of `w13_weight`/`w2_weight` (DeepSeek-V3,
GLM-4.5, GLM-4.7-Flash). Each rollout process decides at model init from its own GPU (sm80+, no expert
parallelism, a validated config) unless `disable_shared_experts_fusion` / `enforce_shared_experts_fusion`
say otherwise. A replica built on the trainer would decide from the trainer's device, so the decision is read
from what the rollout rank published: with fusion its MoE layers publish no `shared_experts` parameter.
The replica is then built with the flag that forces that decision; a contradiction is refused naming both.
Likewise whether the rollout holds its shared expert whole on every rank (SGLang's `SGLANG_SHARED_EXPERT_TP1`
environment variable, which `/server_info` does not report) is read from the published size of its weight.
Pure: no SGLang, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from verl_p2p.errors import RemoteMismatchError

DISABLE = "disable_shared_experts_fusion"
ENFORCE = "enforce_shared_experts_fusion"
SHARED = ".mlp.shared_experts."
ROUTED = ".mlp.experts."
# The rollout's environment setting that builds the shared expert unsharded (tp_size 1) on every rank; p2p
# carries it in the server args it builds replicas from, and the replica's rank context sets it for SGLang.
SHARED_TP1 = "SGLANG_SHARED_EXPERT_TP1"
SHARED_GATE_UP = ".mlp.shared_experts.gate_up_proj.weight"


class SharedExpertsFusionMismatchError(RemoteMismatchError):
    """The rollout's shared-experts fusion disagrees with its server args or with the trainer's replica."""


def _config_int(hf_config: Mapping[str, Any] | Any, key: str) -> int:
    """An integer field of a config dict or a transformers config object (0 when absent or None)."""
    value = hf_config.get(key) if isinstance(hf_config, Mapping) else getattr(hf_config, key, None)
    return int(value or 0)


def has_shared_experts(hf_config: Mapping[str, Any] | Any) -> bool:
    """Whether the model's MoE layers have a shared expert SGLang could fuse (`n_shared_experts` > 0)."""
    return bool(_config_int(hf_config, "n_shared_experts")) and bool(_config_int(hf_config, "n_routed_experts"))


def fused_in(names: Iterable[str]) -> bool | None:
    """From one rank's parameter names: True when its MoE layers hold routed experts but no shared expert
    parameter (fused), False when a shared expert is held apart, None when it holds no MoE layer."""
    names = list(names)
    routed = {n.split(ROUTED)[0] for n in names if ROUTED in n}
    if not routed:
        return None
    shared = {n.split(SHARED)[0] for n in names if SHARED in n}
    return not (routed & shared)


def _flag(server_info: Mapping[str, Any], key: str) -> bool:
    value = server_info.get(key)
    return value is True or str(value).lower() == "true"


def rollout_fusion_args(
    hf_config: Mapping[str, Any] | Any, server_info: Mapping[str, Any], published: Iterable[str], where: str
) -> Mapping[str, Any]:
    """`server_info` with the fusion flag that makes a replica decide as rollout rank `where` did (its
    `published` parameter names). Unchanged for models without a shared expert or ranks without MoE layers.
    Raises SharedExpertsFusionMismatchError when the rank's parameters contradict its server args."""
    if not has_shared_experts(hf_config):
        return server_info
    fused = fused_in(published)
    if fused is None:
        return server_info
    if fused and _flag(server_info, DISABLE):
        raise SharedExpertsFusionMismatchError(
            f"{where}: its server args say {DISABLE}=True but its MoE layers publish no shared-expert "
            "parameters (the shared expert is fused into the routed w13/w2): the server info and the rank "
            "info come from different servers or SGLang changed how it reports fusion; restart the rollout"
        )
    if not fused and _flag(server_info, ENFORCE):
        raise SharedExpertsFusionMismatchError(
            f"{where}: its server args say {ENFORCE}=True but its MoE layers publish their shared expert "
            "apart (not fused): the server info and the rank info disagree; restart the rollout"
        )
    return {**server_info, DISABLE: not fused, ENFORCE: fused}


def check_replica_fusion(plan_names: Iterable[str], published: Iterable[str], where: str) -> None:
    """Refuse when the replica's parameters (`plan_names`) fuse the shared expert and the rollout rank's
    (`published`) do not, or the reverse, naming both decisions and the fix."""
    mine, theirs = fused_in(plan_names), fused_in(published)
    if mine is None or theirs is None or mine == theirs:
        return
    said = {True: "fused into routed w13/w2", False: "a separate shared_experts module"}
    raise SharedExpertsFusionMismatchError(
        f"{where}: the rollout holds the shared expert as {said[theirs]}, but the trainer's replica of that "
        f"rank builds it as {said[mine]} (its SGLang ignored --{ENFORCE.replace('_', '-')}/"
        f"--{DISABLE.replace('_', '-')}, e.g. a quantization that keeps shared experts apart); nothing was "
        f"written. Fix: start the rollout with --{DISABLE.replace('_', '-')} (p2p then builds the same layout), "
        "or run the trainer with the rollout's SGLang release"
    )


def shared_expert_tp1_in(
    hf_config: Mapping[str, Any] | Any, tp_size: int, published_numel: Mapping[str, int]
) -> bool | None:
    """From one rank's published sizes: True when its shared expert's gate_up weight is whole (tp_size 1),
    False when it is the 1/tp_size shard, None when it holds none (fused, no MoE layer) or tp_size is 1."""
    rows = 2 * _config_int(hf_config, "moe_intermediate_size") * _config_int(hf_config, "n_shared_experts")
    whole = rows * _config_int(hf_config, "hidden_size")
    sizes = {n for name, n in published_numel.items() if name.endswith(SHARED_GATE_UP)}
    if tp_size <= 1 or not whole or not sizes:
        return None
    if sizes == {whole}:
        return True
    if sizes == {whole // tp_size}:
        return False
    return None  # neither (another quantization's packing): the replica's own size check names the weight


def rollout_shared_expert_args(
    hf_config: Mapping[str, Any] | Any,
    server_info: Mapping[str, Any],
    published_numel: Mapping[str, int],
    where: str,
) -> Mapping[str, Any]:
    """`server_info` with everything p2p reads of the rollout's shared expert from rank `where`'s published
    parameters (`published_numel`: name -> elements): its fusion decision (`rollout_fusion_args`) and whether
    it holds the shared expert whole (`SHARED_TP1`, set only when it does)."""
    info = rollout_fusion_args(hf_config, server_info, published_numel, where)
    if not has_shared_experts(hf_config):
        return info
    whole = shared_expert_tp1_in(hf_config, int(info.get("tp_size") or 1), published_numel)
    if whole is None or whole == bool(info.get(SHARED_TP1)):
        return info
    return {**info, SHARED_TP1: True} if whole else {k: v for k, v in info.items() if k != SHARED_TP1}

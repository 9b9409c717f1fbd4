"""Shared-experts fusion is read from what a rollout rank publishes (planning/shared_experts.py): the flag that
forces the same decision in the replica, and refusals naming both sides when the answers contradict.
The byte-level proof against a fused SGLang rank is in test_replica_exact_models.py."""

from __future__ import annotations

import pytest

from verl_p2p.planning.shared_experts import (
    DISABLE,
    ENFORCE,
    SharedExpertsFusionMismatchError,
    check_replica_fusion,
    fused_in,
    rollout_fusion_args,
)
from verl_p2p.sandbox.tiny import tiny_config_dict

CFG = tiny_config_dict("deepseek_v3")
DENSE = ["model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"]
FUSED = [*DENSE, "model.layers.1.mlp.experts.w13_weight", "model.layers.1.mlp.experts.w2_weight"]
APART = [*FUSED, "model.layers.1.mlp.shared_experts.gate_up_proj.weight"]


def test_fusion_is_read_from_the_published_names():
    assert fused_in(FUSED) is True and fused_in(APART) is False and fused_in(DENSE) is None


def test_the_replica_is_told_the_rollouts_decision():
    info = {"tp_size": 1, DISABLE: False, ENFORCE: False}
    assert rollout_fusion_args(CFG, info, FUSED, "engine 0 rank 0") == {"tp_size": 1, DISABLE: False, ENFORCE: True}
    assert rollout_fusion_args(CFG, info, APART, "engine 0 rank 0") == {"tp_size": 1, DISABLE: True, ENFORCE: False}
    assert rollout_fusion_args(CFG, info, DENSE, "engine 0 rank 0") is info  # a rank without MoE layers
    qwen = tiny_config_dict("qwen3_moe")  # no shared expert: nothing to decide
    assert rollout_fusion_args(qwen, info, FUSED, "engine 0 rank 0") is info


def test_published_fusion_contradicting_the_server_args_is_refused():
    with pytest.raises(SharedExpertsFusionMismatchError, match=r"engine 2 rank 1: its server args say disable_"):
        rollout_fusion_args(CFG, {DISABLE: True}, FUSED, "engine 2 rank 1")
    with pytest.raises(SharedExpertsFusionMismatchError, match=r"enforce_shared_experts_fusion=True but .* apart"):
        rollout_fusion_args(CFG, {ENFORCE: "true"}, APART, "engine 2 rank 1")


def test_a_replica_that_decided_otherwise_is_refused_naming_both():
    check_replica_fusion(FUSED, FUSED, "engine 0 rank 0")
    with pytest.raises(SharedExpertsFusionMismatchError) as refused:
        check_replica_fusion(APART, FUSED, "engine 0 rank 3")
    text = str(refused.value)
    assert text.startswith("engine 0 rank 3: the rollout holds the shared expert as fused into routed w13/w2")
    assert "replica of that rank builds it as a separate shared_experts module" in text
    assert "nothing was written" in text and "--disable-shared-experts-fusion" in text

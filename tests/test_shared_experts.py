"""Shared-experts fusion is read from what a rollout rank publishes (planning/shared_experts.py): the flag that
forces the same decision in the replica, and refusals naming both sides when the answers contradict.
Whether it holds the shared expert whole (SGLANG_SHARED_EXPERT_TP1, an environment setting) is read from the
published sizes, and the replica's rank context sets that setting for SGLang as the rollout had it, never as the
trainer's own environment says. The byte-level proofs against SGLang ranks are in test_replica_exact_models.py
and test_replica_fp8_mla.py."""

from __future__ import annotations

import pytest

from verl_p2p.planning.shared_experts import (
    DISABLE,
    ENFORCE,
    SHARED_TP1,
    SharedExpertsFusionMismatchError,
    check_replica_fusion,
    fused_in,
    rollout_fusion_args,
    rollout_shared_expert_args,
    shared_expert_tp1_in,
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


SHARED = "model.layers.1.mlp.shared_experts.gate_up_proj.weight"
WHOLE = 2 * CFG["moe_intermediate_size"] * CFG["n_shared_experts"] * CFG["hidden_size"]


def test_a_shared_expert_held_whole_is_read_from_its_published_size():
    assert shared_expert_tp1_in(CFG, 4, {SHARED: WHOLE}) is True
    assert shared_expert_tp1_in(CFG, 4, {SHARED: WHOLE // 4}) is False
    assert shared_expert_tp1_in(CFG, 1, {SHARED: WHOLE}) is None  # one rank: nothing to tell apart
    assert shared_expert_tp1_in(CFG, 4, {n: 1 for n in FUSED}) is None  # fused: no shared weight published
    assert shared_expert_tp1_in(CFG, 4, {SHARED: WHOLE // 3}) is None  # neither: the size check names it later
    info = {"tp_size": 4, DISABLE: False}
    told = rollout_shared_expert_args(CFG, info, {SHARED: WHOLE, **dict.fromkeys(FUSED, 1)}, "engine 0 rank 2")
    assert told == {"tp_size": 4, DISABLE: True, ENFORCE: False, SHARED_TP1: True}
    sharded = rollout_shared_expert_args(CFG, {**info, SHARED_TP1: True}, {SHARED: WHOLE // 4}, "engine 0 rank 2")
    assert SHARED_TP1 not in sharded  # the published size wins over a carried flag
    qwen = tiny_config_dict("qwen3_moe")
    assert rollout_shared_expert_args(qwen, info, {SHARED: WHOLE}, "engine 0 rank 0") is info


def test_the_rank_context_sets_the_rollouts_setting_not_the_trainers(monkeypatch):
    """The trainer's own SGLANG_SHARED_EXPERT_TP1 never reaches the replica; the rollout's (carried in its server
    args) does, for the model build only; plans that differ in it never share a fingerprint."""
    import os

    import torch

    from verl_p2p.planning.hf_names import hf_tensor_specs
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica import RankReplica
    from verl_p2p.replica.rank_context import plan_fingerprint
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()
    specs = {n: (shape, getattr(torch, dtype)) for n, shape, dtype in hf_tensor_specs(CFG)}
    monkeypatch.setenv(SHARED_TP1, "1")  # the trainer's environment
    args = {"tp_size": 2, "ep_size": 2, "dtype": "float32", "device": "cpu"}
    shapes = {}
    for whole in (False, True):
        server_args = {**args, SHARED_TP1: True} if whole else args
        plan = RankReplica.build(CFG, server_args, layout_from_server_args(server_args, 1), specs).plan
        shapes[whole] = plan.params[SHARED].shape
        assert os.environ[SHARED_TP1] == "1"  # restored after the build
    rows = 2 * CFG["moe_intermediate_size"]
    assert shapes == {False: (rows // 2, CFG["hidden_size"]), True: (rows, CFG["hidden_size"])}
    names = {"tp_size", "ep_size", "dtype", "device"}
    assert plan_fingerprint(args, names) != plan_fingerprint({**args, SHARED_TP1: True}, names)
    assert plan_fingerprint(args, names) == plan_fingerprint({**args, SHARED_TP1: False}, names)

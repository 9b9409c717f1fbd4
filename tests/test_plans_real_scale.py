"""Write plans of the published model shapes (real widths, 128/384 experts; 2 layers to keep CI short) at
production layouts: each rank's expert parameters are fed by exactly its own experts, attention follows the
layout, every HF tensor lands somewhere, and DeepSeek-style post-load derivations are
allow-listed (MLA's w_kc/w_vc) or refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl_p2p.planning.hf_names import hf_tensor_specs
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.planning.model_cards import model_card
from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

install_cpu_stubs()

from verl_p2p.replica import RankReplica, WritePlanError, check_hf_coverage, check_syncable  # noqa: E402
from verl_p2p.replica.stream import plan_rank  # noqa: E402


def _specs(cfg):
    return {n: (s, getattr(torch, d)) for n, s, d in hf_tensor_specs(cfg)}


def _expert_ids(feeds, proj: str) -> list[int]:
    return sorted({int(f.split(".")[5]) for f in feeds if f.endswith(f"{proj}.weight")})


LAYOUTS = [
    pytest.param("qwen3-30b-a3b", {"tp_size": 4, "ep_size": 4}, id="30b-tp4-ep4"),
    pytest.param("qwen3-235b-a22b", {"tp_size": 8, "ep_size": 8}, id="235b-tp8-ep8"),
    pytest.param(
        "qwen3-235b-a22b", {"tp_size": 8, "ep_size": 8, "dp_size": 8, "enable_dp_attention": True}, id="235b-dpattn8"
    ),
]


@pytest.mark.parametrize("card, layout_args", LAYOUTS)
def test_qwen3_moe_plans_at_production_layouts(card, layout_args):
    cfg = model_card(card, num_hidden_layers=2)
    specs = _specs(cfg)
    args = dict(layout_args, dtype="bfloat16")
    tp, ep = args["tp_size"], args["ep_size"]
    attn_tp = tp // args.get("dp_size", 1) if args.get("enable_dp_attention") else tp
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    heads, kv, mi, experts = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["moe_intermediate_size"], 128
    local = experts // ep
    plans = []
    for rank in range(tp):
        plan = plan_rank(cfg, args, layout_from_server_args(args, rank), specs).plan
        plans.append(plan)
        assert plan.derived == ()
        for layer in range(2):
            p = f"model.layers.{layer}"
            w13, w2 = plan.params[f"{p}.mlp.experts.w13_weight"], plan.params[f"{p}.mlp.experts.w2_weight"]
            mine = list(range(rank * local, (rank + 1) * local))
            assert _expert_ids(w13.feeds, "gate_proj") == mine == _expert_ids(w13.feeds, "up_proj")
            assert _expert_ids(w2.feeds, "down_proj") == mine and len(w2.feeds) == local
            assert not any("down_proj" in f for f in w13.feeds) and len(w13.feeds) == 2 * local
            assert w13.shape == (local, 2 * mi, h) and w2.shape == (local, h, mi)
            assert len(w13.writes) == 2 * local and all(w.replayable for w in w13.writes)
            # attention: q heads split over the attention-TP group, kv heads split or replicated
            q_rows = heads // attn_tp * hd
            kv_rows = max(1, kv // attn_tp) * hd
            assert plan.params[f"{p}.self_attn.qkv_proj.weight"].shape == (q_rows + 2 * kv_rows, h)
            assert plan.params[f"{p}.self_attn.o_proj.weight"].shape == (h, q_rows)
        expected_bytes = sum(p.numel * p.dtype.itemsize for p in plan.params.values())
        assert plan.nbytes == expected_bytes and all(p.dtype == torch.bfloat16 for p in plan.params.values())
    check_hf_coverage(plans)  # every HF tensor (all 2 x 128 x 3 experts) lands on some rank


def test_kimi_k2_shape_plans_with_mla_derivations_allow_listed():
    """SGLang builds DeepseekV3ForCausalLM on meta and its loader plans fine; `post_load_weights` derives MLA's
    w_kc / w_vc from kv_b_proj into non-parameter tensors a rollout never registers. Those are on the allow-list
    (rebuilt at session end from the written kv_b_proj), so the replica builds; an unknown one is refused."""
    cfg = model_card("kimi-k2", num_hidden_layers=2)  # layer 0 dense, layer 1 with 384 routed experts
    specs = _specs(cfg)
    args = {"tp_size": 8, "ep_size": 8, "dtype": "bfloat16", "device": "cpu"}  # yarn rope asks for the device
    layout = layout_from_server_args(args, 3)
    planned = plan_rank(cfg, args, layout, specs)
    plan = planned.plan
    w13 = plan.params["model.layers.1.mlp.experts.w13_weight"]
    assert _expert_ids(w13.feeds, "gate_proj") == list(range(3 * 48, 4 * 48))
    assert plan.params["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert set(plan.derived) == {f"model.layers.{i}.self_attn.{w}" for i in (0, 1) for w in ("w_kc", "w_vc")}
    RankReplica.build(cfg, args, layout, specs)  # allow-listed: built
    unknown = dataclasses.replace(plan, derived=(*plan.derived, "model.layers.1.mlp.experts.w13_packed"))
    with pytest.raises(WritePlanError, match=r"w13_packed.*post_load_weights.*w_kc/w_vc"):
        check_syncable(unknown)

"""RankReplica in one process (installed SGLang): stager completeness, chunked replay, keys, rejections.

Byte equality with SGLang's own distributed ranks is in test_replica_exact.py; here the replica is checked
against itself and against the checkpoint's id-encoded values.
"""

from __future__ import annotations

import pytest
import torch

from verl_p2p.errors import UnsupportedLayoutError
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
from verl_p2p.sandbox.tiny import hf_tensor_shapes, tiny_config_dict, tiny_state_dict

install_cpu_stubs()

from verl_p2p.replica import (  # noqa: E402
    ParamPlan,
    RankReplica,
    RecordedWrite,
    ReplicaLoadError,
    SourceView,
    UnsupportedSGLangVersionError,
    WritePlan,
    WritePlanError,
    check_hf_coverage,
)
from verl_p2p.replica.plan import validate_write_plan  # noqa: E402

MOE_ARGS = {"tp_size": 2, "ep_size": 2, "dtype": "float32", "device": "cpu"}


def _nan_bytes(p) -> torch.Tensor:
    return torch.full((p.numel,), float("nan"), dtype=p.dtype).view(torch.uint8)


@pytest.fixture(scope="module")
def moe():
    cfg = tiny_config_dict("qwen3_moe", vocab_size=250)
    specs = {n: (s, torch.float32) for n, s in hf_tensor_shapes(cfg)}
    replicas = [RankReplica.build(cfg, MOE_ARGS, layout_from_server_args(MOE_ARGS, r), specs) for r in range(2)]
    return cfg, specs, tiny_state_dict(cfg), replicas


def test_plan_feeds_follow_the_rank(moe):
    cfg, specs, _, (r0, r1) = moe
    qkv = r0.plan.params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.feeds == tuple(f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv")
    w13 = [r.plan.params["model.layers.1.mlp.experts.w13_weight"] for r in (r0, r1)]
    half = cfg["num_experts"] // 2
    assert {f.split(".")[5] for f in w13[0].feeds} == {str(e) for e in range(half)}
    assert {f.split(".")[5] for f in w13[1].feeds} == {str(e) for e in range(half, 2 * half)}
    assert len(w13[0].feeds) == 2 * half and all("gate_proj" in f or "up_proj" in f for f in w13[0].feeds)
    # other EP rank's experts are unused here, but every HF tensor lands on some rank
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in r0.plan.unused_hf_names
    check_hf_coverage([r0.plan, r1.plan])
    with pytest.raises(WritePlanError, match="reach no rollout rank"):
        check_hf_coverage([r0.plan])
    # padded vocab: SGLang fills rows 250..255 of the second lm_head shard
    lm = r1.plan.params["lm_head.weight"]
    assert any(w.op == "fill" for w in lm.writes) and lm.shape == (128, 64)


def test_load_fills_nan_buffer_and_restores_meta(moe):
    _, _, sd, (r0, r1) = moe
    name = "lm_head.weight"
    p = r1.plan.params[name]
    dst = _nan_bytes(p)
    r1.load(name, {f: sd[f] for f in p.feeds}, dst)
    got = dst.view(p.dtype).view(p.shape)
    assert not torch.isnan(got).any()
    assert torch.equal(got[:122], sd[name][128:250])  # rank 1 holds rows 128.. of the 250-row vocab
    assert torch.equal(got[122:], torch.zeros(6, 64))  # SGLang's padding rows
    param = r1._params[name]
    assert param.device.type == "meta" and callable(param.weight_loader)
    with pytest.raises(ReplicaLoadError, match="bytes"):
        r1.load(name, {f: sd[f] for f in p.feeds}, dst[:-4])
    with pytest.raises(ReplicaLoadError, match="needs HF tensors"):
        r1.load(name, {}, dst)
    with pytest.raises(ReplicaLoadError, match="not a parameter"):
        r1.load("model.nope.weight", {}, dst)


def test_stager_releases_fused_params_only_when_complete(moe):
    _, specs, sd, (r0, _) = moe
    stager = r0.stager()
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    w13 = "model.layers.0.mlp.experts.w13_weight"
    assert (
        stager.offer(
            "model.layers.0.mlp.experts.7.gate_proj.weight", sd["model.layers.0.mlp.experts.7.gate_proj.weight"]
        )
        == []
    )
    assert stager.held_bytes() == 0  # another EP rank's expert: ignored, not held
    assert stager.offer("model.layers.0.self_attn.q_proj.weight", sd["model.layers.0.self_attn.q_proj.weight"]) == []
    assert stager.offer("model.layers.0.self_attn.k_proj.weight", sd["model.layers.0.self_attn.k_proj.weight"]) == []
    assert stager.pending()[qkv] == {"model.layers.0.self_attn.v_proj.weight"}
    assert stager.offer("model.layers.0.self_attn.v_proj.weight", sd["model.layers.0.self_attn.v_proj.weight"]) == [qkv]
    assert qkv not in stager.pending()
    qkv_inputs = [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    assert stager.held_bytes() == sum(sd[n].numel() * 4 for n in qkv_inputs)
    feeds = stager.take(qkv)
    assert set(feeds) == set(r0.plan.params[qkv].feeds)
    assert stager.held_bytes() == 0
    with pytest.raises(ReplicaLoadError, match="not complete or already released"):
        stager.take(qkv)
    expert_feeds = list(r0.plan.params[w13].feeds)
    for name in expert_feeds[:-1]:
        assert stager.offer(name, sd[name]) == []
    assert stager.offer(expert_feeds[-1], sd[expert_feeds[-1]]) == [w13]
    with pytest.raises(ReplicaLoadError, match="offered twice"):
        stager.offer(expert_feeds[0], sd[expert_feeds[0]])
    # a stream of every HF tensor completes every parameter exactly once
    full, seen = r0.stager(), []
    for name in specs:
        seen += full.offer(name, sd[name])
        for p in list(seen):
            full.release(p)
    assert sorted(seen) == sorted(r0.plan.params) and not full.pending() and full.held_bytes() == 0


def test_chunks_reassemble_the_same_bytes(moe):
    _, _, sd, (r0, _) = moe
    for name in ("model.layers.1.mlp.experts.w13_weight", "lm_head.weight", "model.embed_tokens.weight"):
        p = r0.plan.params[name]
        feeds = {f: sd[f] for f in p.feeds}
        whole = _nan_bytes(p)
        r0.load(name, feeds, whole)
        unit = p.nbytes // p.shape[0]  # an expert of w13, a row of the 2-D weights
        sizes = (unit, 3 * unit + 5) + ((unit // 4 + 1,) if len(p.shape) == 3 else ())  # rows within an expert
        for max_bytes in sizes:
            ranges = r0.chunks(name, max_bytes)
            assert ranges[0][0] == 0 and sum(n for _, n in ranges) == p.nbytes
            assert all(n <= max_bytes for _, n in ranges) and len(ranges) > 1
            again = _nan_bytes(p)
            for off, n in ranges:
                r0.load_chunk(name, feeds, off, again[off : off + n])
            assert torch.equal(again, whole), (name, max_bytes)
    with pytest.raises(ReplicaLoadError, match="exceeds max_bytes"):
        r0.chunks("lm_head.weight", 64 * 4 - 1)


def test_keys_identify_identical_bytes(moe):
    cfg, specs, _, (r0, r1) = moe
    assert r0.key != r1.key
    other_engine = dict(MOE_ARGS, port=31000, engine_info_bootstrap_port=7001, internal_states=[{"load": 3}])
    again = RankReplica.build(cfg, other_engine, layout_from_server_args(other_engine, 0), specs)
    assert again.key == r0.key and hash(again.key) == hash(r0.key)


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"ep_num_redundant_experts": 2}, "redundant"),
        ({"enable_eplb": True}, "EPLB"),
        ({"init_expert_location": "/tmp/map.json"}, "trivial"),
        ({"quantization": "fp8"}, "quantization"),
        ({"moe_runner_backend": "flashinfer_trtllm"}, "moe_runner_backend"),
    ],
)
def test_unreproducible_layouts_are_rejected(moe, extra, match):
    cfg, specs, _, _ = moe
    args = dict(MOE_ARGS, **extra)
    layout = layout_from_server_args(MOE_ARGS, 0)
    with pytest.raises(UnsupportedLayoutError, match=match):
        RankReplica.build(cfg, args, layout, specs)


def test_rollout_release_must_match_the_trainer(moe):
    cfg, specs, _, _ = moe
    args = dict(MOE_ARGS, version="0.4.0.post1")
    with pytest.raises(UnsupportedLayoutError, match="rollout runs SGLang 0.4.0"):
        RankReplica.build(cfg, args, layout_from_server_args(args, 0), specs)


def test_transformers_config_builds_the_same_plan(moe):
    from transformers import Qwen3MoeConfig

    cfg, specs, _, (r0, _) = moe
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], dtype="float32", **fields)
    again = RankReplica.build(hf, MOE_ARGS, layout_from_server_args(MOE_ARGS, 0), specs)
    assert {n: (p.shape, p.feeds) for n, p in again.plan.params.items()} == {
        n: (p.shape, p.feeds) for n, p in r0.plan.params.items()
    }


def test_layout_must_match_server_args(moe):
    cfg, specs, _, _ = moe
    wrong = layout_from_server_args({"tp_size": 2, "ep_size": 1}, 0)
    with pytest.raises(UnsupportedLayoutError, match="disagrees"):
        RankReplica.build(cfg, MOE_ARGS, wrong, specs)


def test_unsupported_sglang_version_is_named(moe, monkeypatch):
    import sglang

    cfg, specs, _, _ = moe
    monkeypatch.setattr(sglang, "__version__", "0.4.9")
    with pytest.raises(UnsupportedSGLangVersionError, match=r"0\.4\.9.*0\.5\.12"):
        RankReplica.build(cfg, MOE_ARGS, layout_from_server_args(MOE_ARGS, 0), specs)


def test_rank_context_leaves_sglang_globals_as_found(moe):
    import sglang.srt.distributed.parallel_state as ps

    _, _, _, (r0, r1) = moe
    before = ps._TP
    with r0.ctx:
        assert ps.get_tensor_model_parallel_rank() == 0
        with r0.ctx:  # re-entrant
            assert ps.get_moe_expert_parallel_rank() == 0
    with r1.ctx:
        assert ps.get_tensor_model_parallel_rank() == 1 and ps.get_moe_expert_parallel_rank() == 1
    assert ps._TP is before


def _plan(*writes, shape=(4, 3)):
    numel = shape[0] * shape[1]
    p = ParamPlan("w", shape, torch.float32, numel * 4, ("a",), tuple(writes))
    return WritePlan(params={"w": p}, hf_specs={"a": (shape, torch.float32)})


def test_write_plan_validation_catches_gaps_and_double_writes():
    rows = [RecordedWrite("copy", 3 * i, (1, 3), (3, 1), SourceView("a", 3 * i, (1, 3), (3, 1))) for i in range(4)]
    validate_write_plan(_plan(*rows))
    with pytest.raises(WritePlanError, match="3 of 12 elements are never written"):
        validate_write_plan(_plan(*rows[:3]))
    with pytest.raises(WritePlanError, match="written twice"):
        validate_write_plan(_plan(*rows, RecordedWrite("fill", 6, (2,), (1,), fill_value=0)))
    column = RecordedWrite("copy", 1, (4,), (3,), SourceView("a", 1, (4,), (3,)))  # strided: elements 1, 4, 7, 10
    with pytest.raises(WritePlanError, match="written twice"):
        validate_write_plan(_plan(*rows, column))
    with pytest.raises(WritePlanError, match="no checkpoint tensor overwrites"):
        validate_write_plan(_plan())


def test_rank_context_installs_its_own_values_over_live_globals(moe, monkeypatch):
    """Values equal to what the process had at build time are still installed (a live SGLang may change them)."""
    import sglang.srt.layers.dp_attention as dpa

    cfg, specs, _, _ = moe
    args = {"tp_size": 4, "ep_size": 2, "dp_size": 2, "enable_dp_attention": True, "dtype": "float32"}
    monkeypatch.setattr(dpa, "_ATTN_DP_RANK", 0)
    monkeypatch.setattr(dpa, "_ENABLE_DP_ATTENTION_FLAG", True)
    r0, r2 = (RankReplica.build(cfg, args, layout_from_server_args(args, r), specs) for r in (0, 2))
    monkeypatch.setattr(dpa, "_ATTN_DP_RANK", 5)
    monkeypatch.setattr(dpa, "_ENABLE_DP_ATTENTION_FLAG", False)
    for replica, dp_rank in ((r0, 0), (r2, 1)):
        with replica.ctx:
            assert dpa.get_attention_dp_rank() == dp_rank and dpa.is_dp_attention_enabled()
            assert dpa.get_attention_tp_size() == 2
    assert dpa._ATTN_DP_RANK == 5 and dpa._ENABLE_DP_ATTENTION_FLAG is False

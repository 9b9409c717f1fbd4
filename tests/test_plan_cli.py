"""`verl-p2p plan --model`: bytes per link from the write plans equal a count by hand; the planning arithmetic."""

from __future__ import annotations

import json

import pytest

from verl_p2p.cli import main as cli_main
from verl_p2p.planning.hf_names import hf_tensor_specs, pp_stage_of
from verl_p2p.planning.model_cards import PUBLISHED_SYNCS, card_name_of, model_card
from verl_p2p.planning.plan import SourceRank, build_transfer_plan
from verl_p2p.planning.sync_estimate import (
    Parallelism,
    estimate_sync,
    parse_parallelism,
    rollout_server_args,
    stage_bytes,
    trainer_sources,
)
from verl_p2p.planning.targets import TargetRank
from verl_p2p.planning.whole_sync import FSDP_GATHERS_NOT_COUNTED
from verl_p2p.sandbox.tiny import tiny_config_dict


def _hand_count_per_stage(cfg: dict, tp: int, ep: int) -> dict[int, int]:
    """Bytes one rollout rank holds (TP=tp, EP=ep, no DP attention), split as a trainer with pp=2 exports them:
    stage 0 = embeddings + layer 0, stage 1 = layer 1 + final norm + LM head. Counted from the config alone."""
    h, vocab, heads, kv, hd = (cfg[k] for k in ("hidden_size", "vocab_size", "num_attention_heads",
                                                "num_key_value_heads", "head_dim"))  # fmt: skip
    experts, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
    assert vocab % (64 * tp) == 0 and heads % tp == 0 and kv % tp == 0  # no padding, no kv replication
    layer = (
        (heads // tp + 2 * kv // tp) * hd * h  # fused q, k, v rows of this rank
        + h * (heads // tp) * hd  # o_proj columns of this rank
        + 2 * hd  # q_norm, k_norm (whole)
        + 2 * h  # the two layer norms (whole)
        + experts * h  # router (whole)
        + (experts // ep) * 2 * mi * h  # gate+up of this rank's experts
        + (experts // ep) * h * mi  # down of this rank's experts
    )
    embed = vocab // tp * h
    return {0: 4 * (embed + layer), 1: 4 * (layer + h + embed)}  # float32


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    cfg = tiny_config_dict("qwen3_moe")  # vocab 256, hidden 64, 4 heads / 2 kv heads of 16, 8 experts of 32
    path.write_text(json.dumps(cfg))
    return path, cfg


def test_plan_model_bytes_per_link_equal_the_hand_count(tiny_model, tmp_path, capsys):
    path, cfg = tiny_model
    argv = ["plan", "--model", str(path), "--trainer", "tp=2,pp=2,ep=2", "--rollout", "tp=2,ep=2x2"]
    argv += ["--plan-cache-dir", str(tmp_path / "plans"), "--nic-gbps", "0.8", "--convert-gbps", "0.05", "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    hand = _hand_count_per_stage(cfg, tp=2, ep=2)
    # 4 trainer ranks (tp 2 x pp 2, dp 1): sources 0,1 export stage 0; sources 2,3 stage 1. 4 targets: per stage
    # e0r0 -> first sender, e0r1 -> second, e1r0 / e1r1 to the sender already producing that layout
    expected = {
        (0, 0, 0): hand[0],
        (0, 1, 0): hand[0],
        (1, 0, 1): hand[0],
        (1, 1, 1): hand[0],
        (2, 0, 0): hand[1],
        (2, 1, 0): hand[1],
        (3, 0, 1): hand[1],
        (3, 1, 1): hand[1],
    }
    assert {(x["source"], x["engine"], x["rank"]): x["bytes"] for x in out["links"]} == expected
    assert out["target_bytes"] == dict.fromkeys(("e0r0", "e0r1", "e1r0", "e1r1"), hand[0] + hand[1])
    by_rank = {s["rank"]: s for s in out["sources"]}
    for rank, stage in ((0, 0), (1, 0), (2, 1), (3, 1)):
        s = by_rank[rank]
        assert (s["pp_stage"], s["wire_bytes"], s["convert_bytes"]) == (stage, 2 * hand[stage], hand[stage])
        assert s["wire_s"] == pytest.approx(2 * hand[stage] / (0.8e9 / 8))
        assert s["convert_s"] == pytest.approx(hand[stage] / 0.05e9)
    slowest = max(hand.values())
    assert out["wire_floor_s"] == pytest.approx(2 * slowest / 1e8)
    assert out["slowest_source"] in {r for r, s in ((0, 0), (1, 0), (2, 1), (3, 1)) if hand[s] == slowest}
    assert "0.05 GB/s" in out["assumptions"]["convert"] and "--convert-gbps" in out["assumptions"]["convert"]
    # one rank captured: the two ranks of the layout are one SPMD program (tests/test_plan_fast.py)
    assert len(out["plans"]) == 1 and not any(p["cached"] for p in out["plans"]) and out["refused"] == []

    # the table says the same, and a second invocation reads the plan from the cache
    assert cli_main(argv[:-1]) == 0
    captured = capsys.readouterr()
    assert "from the plan cache" in captured.err and "predicted sync" in captured.out
    assert f"e0r0:{hand[0] / 1e6:.2f}MB" in captured.out and "convert: 0.05 GB/s" in captured.out


def test_a_checkpoint_dir_plans_from_its_safetensors_headers(tiny_model, tmp_path, capsys):
    from verl_p2p.sandbox.tiny import write_tiny_checkpoint

    path, cfg = tiny_model
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_moe")
    common = ["--trainer", "tp=1,ep=2", "--rollout", "tp=2,ep=2", "--plan-cache-dir", str(tmp_path / "p"), "--json"]
    assert cli_main(["plan", "--model", str(ckpt), *common]) == 0
    from_dir = json.loads(capsys.readouterr().out)
    assert cli_main(["plan", "--model", str(path), *common]) == 0
    from_config = json.loads(capsys.readouterr().out)
    assert from_dir["links"] == from_config["links"] and from_dir["hf_tensors"] == len(hf_tensor_specs(cfg))
    hand = _hand_count_per_stage(cfg, tp=2, ep=2)
    assert [x["bytes"] for x in from_dir["links"]] == [hand[0] + hand[1]] * 2


def test_unknown_model_types_are_named():
    with pytest.raises(ValueError, match="model_type='mistral'.*safetensors"):
        hf_tensor_specs({"model_type": "mistral"})


def test_bad_layout_specs_are_named(tiny_model, capsys):
    path, _ = tiny_model
    assert cli_main(["plan", "--model", str(path), "--trainer", "tp=2,cp=2", "--rollout", "tp=2"]) == 2
    assert "cp=2" in capsys.readouterr().err
    assert cli_main(["plan", "--model", "no-such-model", "--trainer", "tp=1", "--rollout", "tp=1"]) == 2
    assert "'no-such-model' is neither a file" in capsys.readouterr().err


def test_parse_and_trainer_sources():
    assert parse_parallelism("tp=8,ep=8,dp_attn=8x4", ("tp", "ep", "dp_attn")) == Parallelism(
        tp=8, ep=8, dp_attn=8, engines=4
    )
    trainer = parse_parallelism("tp=4,pp=2,ep=8", ("tp", "pp", "ep", "dp"))
    assert trainer.trainer_dp == 2 and trainer.trainer_ranks == 16
    sources = trainer_sources(trainer)
    assert [s.pp_stage for s in sources] == [0] * 8 + [1] * 8 and sources[8] == SourceRank(8, 1)
    with pytest.raises(ValueError, match="does not divide"):
        trainer_sources(Parallelism(tp=4, ep=3, dp=1))
    with pytest.raises(ValueError, match="positive"):
        parse_parallelism("tp=0", ("tp",))
    assert rollout_server_args(Parallelism(tp=8, ep=8, dp_attn=8)) == {
        "tp_size": 8,
        "ep_size": 8,
        "dtype": "bfloat16",
        "dp_size": 8,
        "enable_dp_attention": True,
    }


def test_stage_bytes_and_the_estimate_formula():
    assert pp_stage_of("model.embed_tokens.weight", 4, 2) == 0 and pp_stage_of("lm_head.weight", 4, 2) == 1
    assert pp_stage_of("model.layers.1.x", 4, 2) == 0 and pp_stage_of("model.layers.2.x", 4, 2) == 1
    params = [("a", 10, ["model.layers.0.q"]), ("b", 7, ["model.layers.3.q"]), ("pad", 3, [])]
    assert stage_bytes(params, 4, 2) == {0: 13, 1: 7}
    with pytest.raises(ValueError, match="stages"):
        stage_bytes([("mixed", 1, ["model.layers.0.q", "model.layers.3.q"])], 4, 2)
    targets = [TargetRank(0, 0), TargetRank(1, 0)]
    plan = build_transfer_plan([SourceRank(0, 0)], targets, dict.fromkeys(targets, "k"))
    est = estimate_sync(plan, dict.fromkeys(targets, {0: 10**9}), dict.fromkeys(targets, "k"), 80, 1, 10**8)
    (s,) = est.sources
    assert (s.wire_bytes, s.convert_bytes) == (2 * 10**9, 10**9)  # one layout: converted once, written twice
    assert s.wire_s == pytest.approx(0.2) and s.convert_s == pytest.approx(1.0)
    assert s.predicted_s == pytest.approx(1.0 + 0.01)  # max + one slot on the faster side (0.1 GB at 10 GB/s)
    assert est.wire_floor_s == pytest.approx(0.2) and est.predicted_s == s.predicted_s
    # each target's 1 GB over its own 10 GB/s NIC: 0.1 s, below the sender's bounds here
    assert est.receive_floor_s == pytest.approx(0.1) and est.bound == "convert"
    slow_rollout = estimate_sync(
        plan, dict.fromkeys(targets, {0: 10**9}), dict.fromkeys(targets, "k"), 80, 1, 10**8, rollout_nic_gbits=4
    )
    assert slow_rollout.receive_floor_s == pytest.approx(2.0) and slow_rollout.predicted_s == pytest.approx(2.0)
    assert slow_rollout.bound == "receive" and slow_rollout.wire_floor_s == pytest.approx(2.0)


def test_model_cards_are_the_published_shapes():
    q30, q235 = model_card("qwen3-30b-a3b"), model_card("Qwen3-235B-A22B")
    assert (q30["num_hidden_layers"], q30["num_experts"], q30["hidden_size"], q30["moe_intermediate_size"]) == (
        48,
        128,
        2048,
        768,
    )
    assert (q235["num_hidden_layers"], q235["hidden_size"], q235["num_attention_heads"]) == (94, 4096, 64)
    # parameter counts from the generated tensor lists match the published totals (30.5B, 235B, 671B, 1.0T, 106B)
    totals = {}
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2", "glm-4.5-air"):
        specs = hf_tensor_specs(model_card(name))
        totals[name] = sum(_numel(s) for _, s, _ in specs)
    assert 30.0e9 < totals["qwen3-30b-a3b"] < 31.0e9
    assert 234e9 < totals["qwen3-235b-a22b"] < 236e9
    assert 665e9 < totals["deepseek-v3"] < 675e9  # without the multi-token-prediction layer
    assert 1.02e12 < totals["kimi-k2"] < 1.04e12
    assert 105e9 < totals["glm-4.5-air"] < 108e9  # 106B published; MTP layer left out
    assert card_name_of(model_card("qwen3-30b-a3b")) == "qwen3-30b-a3b"
    assert card_name_of(model_card("qwen3-30b-a3b", 2)) is None
    assert {p.card for p in PUBLISHED_SYNCS} >= {"qwen3-30b-a3b", "qwen3-235b-a22b", "kimi-k2"}
    for p in PUBLISHED_SYNCS:
        trainer_sources(p.trainer)
        rollout_server_args(p.rollout)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_plan_splits_each_target_over_the_idle_sources_and_shows_both(tiny_model, tmp_path, capsys):
    """4 trainer ranks (dp 4) -> 2 rollout ranks: each rank's bytes split over 2 sources (every NIC sends), the
    parts from the write plan's parameters, together exactly the rank; the prediction without the split beside."""
    path, cfg = tiny_model
    argv = ["plan", "--model", str(path), "--trainer", "tp=1,ep=1,dp=4", "--rollout", "tp=2,ep=2"]
    # the rollout GPUs' NICs twice as fast as the trainer's: two senders per rank can fill one
    argv += ["--plan-cache-dir", str(tmp_path / "plans"), "--nic-gbps", "0.8", "--rollout-nic-gbps", "1.6"]
    argv += ["--convert-gbps", "1000", "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["senders"] == 4 and out["senders_without_split"] == 2 and out["bound"] == "send"
    per_target: dict[str, list[int]] = {}
    for link in out["links"]:
        per_target.setdefault(f"e{link['engine']}r{link['rank']}", []).append(link["bytes"])
        assert link["part"][1] == 2
    for target, parts in per_target.items():
        assert len(parts) == 2 and sum(parts) == out["target_bytes"][target]  # every byte once
    assert [s["wire_bytes"] for s in out["sources"]] == [per_target["e0r0"][0], per_target["e0r1"][0]] + [
        per_target["e0r0"][1],
        per_target["e0r1"][1],
    ]
    assert out["predicted_s"] < 0.6 * out["predicted_without_split_s"]
    assert cli_main(argv[:-1]) == 0
    text = capsys.readouterr().out
    # the four sources' rows are alike apart from their targets: folded into one line naming the first and last
    assert "sources 0-3 (4 alike)" in text and "source 3: e0r1[2/2]:" in text
    assert "without the split" in text and "4 of 4 sources send" in text

    # equal NICs on both sides: a rank's bytes still arrive through its one NIC, so the split cannot beat that
    argv[argv.index("--rollout-nic-gbps") + 1] = "0.8"
    assert cli_main(argv) == 0
    same = json.loads(capsys.readouterr().out)
    biggest = max(same["target_bytes"].values())
    assert same["bound"] == "receive" and same["receive_floor_s"] == pytest.approx(biggest / 1e8)
    assert same["predicted_s"] == same["wire_floor_s"] == same["receive_floor_s"] > same["send_floor_s"]
    assert same["predicted_s"] >= 0.99 * same["predicted_without_split_s"]


def test_rollout_layouts_that_keep_the_dense_mlp_and_shared_expert_whole(tmp_path, capsys):
    """`moe_dense_tp=1` (SGLang's --moe-dense-tp-size 1) and `shared_tp=1` (SGLANG_SHARED_EXPERT_TP1=1): the
    layouts whose FP8 block rule lets Kimi-K2 run on 32-GPU engines. Each rank then holds the dense MLP and the
    shared expert whole: the plan's bytes per rank grow by exactly the shards it no longer splits 4 ways."""
    cfg = tiny_config_dict("deepseek_v3")  # 3 layers (the first dense), hidden 64, one shared expert of 32
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    itemsize = {"bfloat16": 2, "float32": 4}[cfg.get("torch_dtype", "bfloat16")]

    def rank_bytes(rollout: str) -> int:
        argv = ["plan", "--model", str(path), "--trainer", "tp=1", "--rollout", rollout, "--json"]
        assert cli_main([*argv, "--plan-cache-dir", str(tmp_path / "plans")]) == 0
        out = json.loads(capsys.readouterr().out)
        assert len(set(out["target_bytes"].values())) == 1, out["target_bytes"]
        return out["target_bytes"]["e0r0"]

    plain, dense, shared = (rank_bytes(r) for r in ("tp=4,ep=4", "tp=4,ep=4,moe_dense_tp=1", "tp=4,ep=4,shared_tp=1"))
    both = rank_bytes("tp=4,ep=4,moe_dense_tp=1,shared_tp=1")
    h, mlp, moe = cfg["hidden_size"], cfg["intermediate_size"], cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    dense_whole = 3 * mlp * h * cfg["first_k_dense_replace"] * itemsize  # gate, up, down
    shared_whole = 3 * moe * h * moe_layers * itemsize
    assert dense - plain == dense_whole * 3 // 4
    assert shared - plain == shared_whole * 3 // 4
    assert both - plain == (dense_whole + shared_whole) * 3 // 4
    assert cli_main(["plan", "--model", str(path), "--trainer", "tp=1", "--rollout", "tp=4,ep=4,shared_tp=2"]) == 2
    assert "shared_tp=2: SGLang takes 1" in capsys.readouterr().err
    assert parse_parallelism("tp=32,ep=32,moe_dense_tp=1,shared_tp=1x4", ("tp", "ep", "moe_dense_tp", "shared_tp")) == (
        Parallelism(tp=32, ep=32, moe_dense_tp=1, shared_tp=1, engines=4)
    )
    assert rollout_server_args(Parallelism(tp=32, ep=32, moe_dense_tp=1, shared_tp=1)) == {
        "tp_size": 32,
        "ep_size": 32,
        "dtype": "bfloat16",
        "moe_dense_tp_size": 1,
        "SGLANG_SHARED_EXPERT_TP1": True,
    }


def test_plan_an_fsdp_trainer_every_rank_sends_a_part_of_every_target(tiny_model, tmp_path, capsys):
    """`--trainer fsdp=N`: every FSDP rank streams the whole model, so each writes its byte-balanced part of every
    target (N x targets links); the parts of a target add up to its bytes, and every rank sends."""
    path, cfg = tiny_model
    argv = ["plan", "--model", str(path), "--trainer", "fsdp=4", "--rollout", "tp=2,ep=2x2"]
    argv += ["--plan-cache-dir", str(tmp_path / "plans"), "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    whole = sum(_hand_count_per_stage(cfg, tp=2, ep=2).values())  # every layer, one stage
    links = {(x["source"], x["engine"], x["rank"]): x["bytes"] for x in out["links"]}
    assert {s for s, _, _ in links} == {0, 1, 2, 3} and len(links) == 4 * 4
    for engine, rank in ((0, 0), (0, 1), (1, 0), (1, 1)):
        assert sum(links[(s, engine, rank)] for s in range(4)) == whole
    assert out["senders"] == 4 and out["trainer"]["layout"] == "fsdp=4"
    # its export is every rank's full-tensor gathers, not Megatron's (what the footer names as left out)
    assert "FSDP rank's full-tensor gathers" in out["assumptions"]["not_counted"]
    assert "Megatron" not in out["assumptions"]["not_counted"]
    # the whole sync names the gathers it cannot count (no measured rate), a Megatron trainer's names nothing
    assert out["whole_sync"]["not_counted"] == [FSDP_GATHERS_NOT_COUNTED]
    assert cli_main([*argv[:4], "tp=1,dp=4", *argv[5:]]) == 0
    assert json.loads(capsys.readouterr().out)["whole_sync"]["not_counted"] == []
    assert cli_main(["plan", "--model", str(path), "--trainer", "fsdp=4,tp=2", "--rollout", "tp=2"]) == 2

"""Issue 35's CPU parts: the real-width shapes (as `--size real` overrides), the one-GPU arithmetic that picks their
depths, the write plans SGLang's own DeepSeek-V3 class gives them (bf16 and block-FP8), and scripts/cost_growth.py
end to end at a tiny width with the loopback rollout (its JSON and PNG)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_p2p.e2e.real_sizes import (
    GIB,
    H200_BYTES,
    QWEN3_FLOOR_LAYERS,
    REAL_SIZES,
    budget_of,
    deepseek_v3,
    disk_budget,
    gpu_step,
    largest_depth,
    one_gpu_budget,
    qwen3_30b_a3b,
    sglang_kv_room,
    sync_bytes,
    usable_gpu_bytes,
)
from verl_p2p.planning.hf_names import hf_tensor_specs
from verl_p2p.sandbox.tiny import tiny_config_dict

ROOT = Path(__file__).resolve().parents[1]


def test_deepseek_v3_has_the_published_widths_a_dense_and_a_moe_layer():
    cfg = deepseek_v3()
    widths = dict(
        hidden_size=7168,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_attention_heads=128,
        n_routed_experts=256,
        moe_intermediate_size=2048,
        num_experts_per_tok=8,
        n_shared_experts=1,
        vocab_size=129280,
        num_hidden_layers=2,
        first_k_dense_replace=1,
    )
    assert {k: cfg[k] for k in widths} == widths
    assert cfg["rope_scaling"]["type"] == "yarn" and "quantization_config" not in cfg
    names = [n for n, _, _ in hf_tensor_specs(cfg)]
    assert "model.layers.0.mlp.gate_proj.weight" in names  # dense first layer
    assert "model.layers.1.mlp.experts.255.down_proj.weight" in names  # 256 routed experts
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    assert deepseek_v3(fp8=True)["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    with pytest.raises(ValueError, match="at least one MoE layer"):
        deepseek_v3(1)


def test_real_sizes_are_overrides_the_e2e_turns_into_the_real_configs():
    """`--size real` goes through the e2e's path: `tiny_config_dict(arch, **overrides)` must give the real shape."""
    for arch, expected in (("deepseek_v3", deepseek_v3()), ("qwen3_moe", qwen3_30b_a3b(15))):
        built = tiny_config_dict(arch, **REAL_SIZES[arch])
        built["torch_dtype"] = "bfloat16"
        assert hf_tensor_specs(built) == hf_tensor_specs(expected)


def test_qwen3_30b_a3b_bytes_per_depth_meet_issue_35s_sizes():
    at24, at48 = sync_bytes(qwen3_30b_a3b(24)), sync_bytes(qwen3_30b_a3b(48))
    assert at24.tensors >= 9000 and at24.bf16_bytes >= 28e9  # the issue's floor for the deep run
    assert at48.tensors == 18867 and 60e9 < at48.bf16_bytes < 62e9  # the whole model, as published
    assert at24.fp8_tensors > at24.tensors and at24.fp8_bytes < 0.55 * at24.bf16_bytes  # scales added, half the bytes
    with pytest.raises(ValueError, match="1..48"):
        qwen3_30b_a3b(49)
    # the budgets' per-depth figures (one layer's increment per layer) equal a count of every tensor
    from verl_p2p.e2e.real_sizes import qwen3_sync_bytes

    assert qwen3_sync_bytes(24) == at24 and qwen3_sync_bytes(48) == at48


def test_one_gpu_budget_follows_sglangs_kv_rule():
    """A server's KV room is mem_fraction x the memory free when it starts less its weights; once up it holds its
    weights and its (capped) pool, not its whole fraction: the fresh one starts beside that."""
    fits = one_gpu_budget(10 * GIB, 10 * GIB, gpu_bytes=100 * GIB, slot_bytes=0, kv_min_bytes=GIB, context_bytes=0)
    assert fits.fits and fits.mem_fraction is not None
    free_last = 100 - 20 - 11  # beside the trainer's 2 x 10 and the first server's 10 + 1
    assert fits.free_last_bytes == free_last * GIB
    assert sglang_kv_room(free_last, free_last - 10, fits.mem_fraction) >= 1
    assert sglang_kv_room(free_last, free_last - 10, fits.mem_fraction - 0.01) < 1  # the smallest that admits
    tight = one_gpu_budget(40 * GIB, 10 * GIB, gpu_bytes=100 * GIB, slot_bytes=0, kv_min_bytes=GIB, context_bytes=0)
    assert not tight.fits and "only 9.0 GiB are free" in tight.why  # less than the fresh server's 11
    steep = one_gpu_budget(
        int(38.75 * GIB), 10 * GIB, gpu_bytes=100 * GIB, slot_bytes=0, kv_min_bytes=GIB, context_bytes=0
    )
    assert not steep.fits and "mem_fraction of 0.96, above 0.95" in steep.why  # 11 of 11.5 GiB
    alone = one_gpu_budget(
        40 * GIB, 10 * GIB, fresh_server=False, gpu_bytes=100 * GIB, slot_bytes=0, kv_min_bytes=GIB, context_bytes=0
    )
    assert alone.fits


def test_largest_depths_on_one_h200():
    """What docs/measurements/real_sizes.md states: bf16 with a fresh server holds REAL_SIZES' depth (15) and more,
    up to 25; 48 layers fit in no e2e."""
    assert largest_depth("bf16") == 25 >= REAL_SIZES["qwen3_moe"]["num_hidden_layers"] == 15
    assert largest_depth("bf16", fresh_server=False) == 34
    assert largest_depth("fp8") == 32 and largest_depth("fp8", fresh_server=False) == 41
    assert not budget_of(qwen3_30b_a3b(26), "bf16").fits
    assert budget_of(qwen3_30b_a3b(26), "bf16", fresh_server=False).fits
    assert "after the trainer" in budget_of(qwen3_30b_a3b(48), "fp8", fresh_server=False).why
    assert budget_of(deepseek_v3(), "fp8").fits and budget_of(deepseek_v3(), "bf16").fits
    # the disk (64 GiB) binds before the GPU for FP8: four checkpoints are written
    assert largest_depth("fp8", disk=True) == 14 and largest_depth("bf16", disk=True) == 22
    assert not disk_budget(deepseek_v3(), "fp8").fits and disk_budget(deepseek_v3(), "bf16").fits
    with pytest.raises(ValueError, match="bf16' or 'fp8'"):
        budget_of(deepseek_v3(), "int4")


@pytest.mark.slow  # imports SGLang, builds DeepSeek-V3's real-width class on meta
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sglang_plans_deepseek_v3_at_real_widths(fp8):
    """SGLang's own DeepseekV3ForCausalLM at the published widths takes every HF tensor of the dense and the MoE
    layer (bf16, and the block-FP8 checkpoint the trainer's quantizer writes); MLA's post-load tensors (w_kc / w_vc,
    and on this CPU path their FP8 scales) are the allow-listed ones."""
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()
    from verl_p2p.cli.plan import fp8_rollout
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica import check_hf_coverage, check_syncable
    from verl_p2p.replica.stream import plan_rank

    cfg = dict(deepseek_v3(), torch_dtype="bfloat16")
    specs = {n: (s, getattr(torch, d)) for n, s, d in hf_tensor_specs(cfg)}
    if fp8:
        cfg, specs = fp8_rollout(cfg, specs)
    args = {"tp_size": 1, "ep_size": 1, "dtype": "bfloat16", "device": "cpu"}
    plan = plan_rank(cfg, args, layout_from_server_args(args, 0), specs).plan
    check_hf_coverage([plan])
    assert plan.params["model.layers.1.mlp.experts.w13_weight"].shape[0] == 256
    assert "model.layers.0.mlp.gate_up_proj.weight" in plan.params
    if fp8:
        assert plan.params["model.layers.1.mlp.experts.w13_weight"].dtype == torch.float8_e4m3fn
    check_syncable(plan)  # its post-load tensors are all on the allow-list (rebuilt from kv_b_proj)
    assert {d.rsplit(".", 1)[-1] for d in plan.derived} >= {"w_kc", "w_vc"}
    expected = sync_bytes(deepseek_v3())
    assert plan.nbytes == pytest.approx(expected.fp8_bytes if fp8 else expected.bf16_bytes, rel=0.02)


def _cost_growth(*argv: str, timeout: int = 900) -> subprocess.CompletedProcess:
    # the GPU's memory.total the mem-fraction arithmetic plans with, here an H100 80GB: a CPU host has no nvidia-smi
    env = dict(os.environ, PYTHONPATH=str(ROOT), MC_LOG_LEVEL="ERROR", VERL_P2P_GPU_MIB="81559")
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cost_growth.py"), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.slow  # two e2e harnesses (loopback rollout, trainer process, Mooncake over loopback tcp)
def test_cost_growth_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "cg.json"
    proc = _cost_growth(
        "--device", "cpu", "--width", "tiny", "--depths", "1,2", "--layouts", "tp1", "--syncs", "2",
        "--raw-syncs", "1", "--bucket-mb", "1", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["commands"][0].startswith("python3 scripts/cost_growth.py --device cpu")
    assert report["configs"]["2"]["num_hidden_layers"] == 2 and report["configs"]["2"]["num_experts"] == 8
    rows = {r["depth"]: r for r in report["depths"]}
    assert set(rows) == {1, 2} and all(r["passed"] for r in rows.values())
    assert rows[2]["bytes"] > rows[1]["bytes"] and rows[2]["hf_tensors"] > rows[1]["hf_tensors"]
    for r in rows.values():
        assert r["paused_s"]["first"] > 0 and r["paused_s"]["steady_median"] > 0
        assert r["paused_s"]["after_trainer_restart"] > 0  # the kill drill's recovery sync
        assert r["raw_write_s_median"] > 0 and r["push_over_raw_median"] > 0
        assert r["conversion_gbps_median"] > 0 and r["host_s_per_tensor_median"] > 0
        assert r["trainer_apply_before_pause_s"]["first"] > r["trainer_apply_before_pause_s"]["steady_median"]
        assert r["trainer_memory_beyond_model_bytes"]["host"] is not None and r["memory_over_slots"] is not None
    plans = {p["depth"]: p for p in report["plans"]}
    assert plans[1]["ranks"][0]["cached_s"] < plans[1]["ranks"][0]["cold_s"]
    # the e2e's loopback trainer holds float32: one plan's bytes are what each push moved
    assert plans[2]["ranks"][0]["bytes"] == rows[2]["bytes"]
    names = {g["goal"] for g in report["goals"]}
    assert {"first_over_steady", "restart_over_steady", "memory_over_slots"} <= names
    assert "goal first_over_steady" in proc.stdout
    assert report["growth_fit"]["bf16"]["fixed_s"] is not None
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cost_growth_refuses_bad_input_before_anything_runs(tmp_path):
    out = tmp_path / "x.json"
    cases = [
        (["--device", "cpu", "--width", "tiny", "--quant", "fp8"], "multiples of 128"),
        (["--width", "real", "--depths", "49", "--plan-only"], "1..48"),
        (["--device", "cpu", "--width", "real", "--depths", "2"], "--plan-only"),
        (["--depths", "a,b"], "comma list of integers"),
        (["--device", "cpu", "--width", "tiny", "--layouts", "tp3"], "unknown --quant/--layouts"),
        # a depth the GPU cannot hold is refused with the arithmetic, before a checkpoint is written
        (["--device", "cuda", "--width", "real", "--rollout", "sglang", "--depths", "48"], "does not fit on this GPU"),
    ]
    for argv, message in cases:
        proc = _cost_growth(*argv, "--out", str(out), timeout=300)
        assert proc.returncode != 0 and message in proc.stderr, (argv, proc.stderr[-1500:])
        assert not out.exists()


H100_MIB = 81_559  # nvidia-smi's memory.total of an H100 80GB (the H200's: 143,771)


def test_gpu_steps_take_their_depth_and_mem_fractions_from_the_arithmetic(tmp_path):
    """scripts/gpu_real_sizes.sh's dry step prints each e2e with the depth and mem fraction `gpu_step` computes for
    the GPU it is told of (here an 80 GB H100, the GPU offered when no H200 starts); a step that fits no single mem
    fraction is refused with the arithmetic, on stderr. One run of the script: it starts a Python per step."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_real_sizes.sh"), "dry"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path), GPU_MIB=str(H100_MIB), GPU_NAME="h100"),
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    gpu_bytes = usable_gpu_bytes(H100_MIB)
    for step, model, quant, one in (
        ("dsv3-fp8", "deepseek_v3", "fp8", False),
        ("qwen3-bf16", "qwen3_moe", "bf16", False),
        ("qwen3-fp8", "qwen3_moe", "fp8", False),
        ("qwen3-bf16-24", "qwen3_moe", "bf16", True),
    ):
        planned = gpu_step(model, quant, gpu_bytes=gpu_bytes, one_server=one)
        if planned.refusal:
            assert f"{step}: does not fit: {planned.refusal}" in done.stderr, done.stderr
            continue
        fp8 = (" --fp8" if quant == "fp8" else "") + (" --one-server-at-a-time" if one else "")
        line = f"{step}: e2e --models {model}{fp8} --layers {planned.layers} --mem-fraction {planned.mem_fraction}"
        assert line in done.stdout.replace("  ", " "), done.stdout
    assert gpu_step("qwen3_moe", "bf16", gpu_bytes=gpu_bytes).layers == 12
    assert gpu_step("qwen3_moe", "fp8", gpu_bytes=gpu_bytes).layers == 15
    assert gpu_step("qwen3_moe", "bf16", gpu_bytes=gpu_bytes, one_server=True).layers == 18
    assert "only 1.4 GiB are free" in gpu_step("deepseek_v3", "fp8", gpu_bytes=gpu_bytes).refusal


def test_on_an_h200_the_steps_are_what_real_sizes_md_plans():
    assert usable_gpu_bytes(143_771) == H200_BYTES  # the H200's memory.total gives the budget's 139 GiB
    assert gpu_step("qwen3_moe", "bf16").layers == REAL_SIZES["qwen3_moe"]["num_hidden_layers"] == 15
    assert gpu_step("qwen3_moe", "bf16").mem_fraction == budget_of(qwen3_30b_a3b(15), "bf16").mem_fraction
    dsv3 = gpu_step("deepseek_v3", "fp8")
    assert not dsv3.refusal and dsv3.mem_fraction == budget_of(deepseek_v3(), "fp8").mem_fraction
    floor = gpu_step("qwen3_moe", "bf16", one_server=True)  # issue 35's floor, one server at a time
    assert floor.layers == QWEN3_FLOOR_LAYERS == 24 and not floor.refusal and floor.mem_fraction == 0.44
    assert not budget_of(qwen3_30b_a3b(26), "bf16").fits  # beside a fresh server 26 layers would not fit


def test_an_e2e_depth_below_one_layer_is_refused():
    done = subprocess.run(
        [sys.executable, "-m", "verl_p2p.e2e.run", "--layers", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "--layers 0: a model needs at least one layer" in done.stderr


def test_e2e_takes_size_real_with_the_real_shapes():
    """`verl-p2p e2e --size real` is what scripts/gpu_real_sizes.sh runs: the shapes must be registered there."""
    from verl_p2p.e2e.real_sizes import REAL_SIZES
    from verl_p2p.e2e.sizes import SIZES

    assert SIZES["real"] is REAL_SIZES and set(REAL_SIZES) >= {"deepseek_v3", "qwen3_moe"}

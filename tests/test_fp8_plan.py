"""FP8 targets in the planner: the block-FP8 checkpoint's tensor list (`BlockFp8Scheme.checkpoint_specs`),
`verl-p2p plan --rollout-quant fp8`, and the rollout-local parameters an FP8 MLA rollout creates (its attention's
kv-cache scales, which no checkpoint tensor feeds and no sync may write)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from verl_p2p.cli.plan import fp8_rollout
from verl_p2p.errors import QuantizationError, RemoteMismatchError
from verl_p2p.quant.block_fp8 import BlockFp8Scheme
from verl_p2p.replica.plan import rollout_local_params
from verl_p2p.sandbox.tiny import hf_tensor_shapes, tiny_config_dict
from verl_p2p.trainer.coverage import check_coverage
from verl_p2p.trainer.fp8_checkpoint import DEFAULT_QUANTIZATION_CONFIG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every projection shard a multiple of 128 (SGLang's block rule), MLA ranks and heads included
MLA_128 = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=128,
    q_lora_rank=256,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    vocab_size=512,
)


def _specs(cfg: dict) -> dict:
    return {name: (shape, torch.bfloat16) for name, shape in hf_tensor_shapes(cfg)}


def test_checkpoint_specs_quantize_exactly_the_decoder_projections_with_a_scale_after_each():
    specs = _specs(tiny_config_dict("deepseek_v3", **MLA_128))
    out = BlockFp8Scheme.from_quantization_config(DEFAULT_QUANTIZATION_CONFIG).checkpoint_specs(specs)
    names = list(out)
    for name, (shape, dtype) in specs.items():
        leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
        projection = name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2
        if projection and leaf not in ("gate", "kv_a_layernorm", "q_a_layernorm"):
            assert out[name] == (tuple(shape), torch.float8_e4m3fn), name
            scale = name.removesuffix("weight") + "weight_scale_inv"
            assert out[scale] == (tuple(-(-d // 128) for d in shape), torch.float32)
            assert names.index(scale) == names.index(name) + 1  # the checkpoint's order: weight, then its scale
        else:  # embeddings, lm_head, norms, the router: the trainer's dtype
            assert out[name] == (shape, dtype), name
    nbytes = {k: torch.Size(s).numel() * d.itemsize for k, (s, d) in out.items()}
    assert sum(nbytes.values()) < sum(torch.Size(s).numel() * d.itemsize for s, d in specs.values())


def test_fp8_rollout_adds_the_quantization_config_and_keeps_or_refuses_an_existing_one():
    cfg = tiny_config_dict("qwen3_moe")
    specs = _specs(cfg)
    fp8_cfg, fp8_specs = fp8_rollout(cfg, specs)
    assert fp8_cfg["quantization_config"] == DEFAULT_QUANTIZATION_CONFIG and "quantization_config" not in cfg
    assert any(d == torch.float8_e4m3fn for _, d in fp8_specs.values())
    assert fp8_rollout(fp8_cfg, fp8_specs) == (fp8_cfg, fp8_specs)  # an FP8 checkpoint dir: as it is
    foreign = {**cfg, "quantization_config": {**DEFAULT_QUANTIZATION_CONFIG, "scale_fmt": "ue8m0"}}
    with pytest.raises(QuantizationError, match="scale_fmt"):
        fp8_rollout(foreign, specs)


def test_rollout_local_params_are_only_flagged_parameters_no_loader_wrote():
    def param(flag: bool) -> torch.nn.Parameter:
        p = torch.nn.Parameter(torch.empty(1, device="meta"), requires_grad=False)
        if flag:
            p._skip_weight_check = True
        return p

    params = {"attn.k_scale": param(True), "attn.v_scale": param(True), "static.k_scale": param(True)}
    params["weight"] = param(False)  # unwritten but not SGLang's own: stays an error of validate_write_plan
    writes = {"static.k_scale": ["a write from a checkpoint tensor"]}
    assert rollout_local_params(params, writes) == ("attn.k_scale", "attn.v_scale")


def test_coverage_takes_local_params_as_accounted_for_and_nothing_else():
    published = ["w", "attn.k_scale"]
    check_coverage({"e0r0": (published, ["w", "attn.k_scale"])})
    with pytest.raises(RemoteMismatchError, match="attn.k_scale"):
        check_coverage({"e0r0": (published, ["w"])})


@pytest.mark.timeout(600)
def test_plan_cli_plans_an_fp8_mla_rollout_with_its_kv_scales_left_local(tmp_path):
    """`verl-p2p plan --rollout-quant fp8` on DeepSeek-V3's MLA: SGLang's Fp8 method gives each attention
    `k_scale`/`v_scale` parameters no checkpoint tensor feeds; the plan keeps them local (not an error), and
    the rollout holds fewer bytes than the bf16 trainer streams."""
    cfg = tiny_config_dict("deepseek_v3", torch_dtype="bfloat16", **MLA_128)  # SGLang's fp8 takes bf16/fp16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    done = subprocess.run(
        [sys.executable, "-m", "verl_p2p.cli", "plan", "--model", str(tmp_path / "config.json")]
        + ["--trainer", "tp=1", "--rollout", "tp=2", "--rollout-quant", "fp8", "--plan-cache-dir", "", "--json"],
        capture_output=True,
        text=True,
        timeout=580,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["rollout_quant"] == "fp8" and 0 < out["rollout_bytes"] < out["hf_bytes"]
    assert out["predicted_s"] > 0 and len(out["plans"]) == 1  # one rank per layout (test_plan_fast.py)
    # the FP8 dequant's derived scales (w_scale on this CPU path) are MLA's allow-listed derivation, not a refusal
    assert not [r for r in out["refused"] if "w_scale" in r.split("allow-listed")[0]], out["refused"]

    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica.stream import plan_rank
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()
    fp8_cfg, specs = fp8_rollout(cfg, _specs(cfg))
    server_args = out["plans"][0]["server_args"]
    plan = plan_rank(fp8_cfg, server_args, layout_from_server_args(server_args, 0), specs, None).plan
    layers = cfg["num_hidden_layers"]
    assert len(plan.local) == 2 * layers * 2 or len(plan.local) == 2 * layers  # k/v per RadixAttention
    assert all(n.endswith(("k_scale", "v_scale")) for n in plan.local)
    assert not set(plan.local) & set(plan.params)

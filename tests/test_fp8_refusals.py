"""FP8 rollouts the replica cannot reproduce are refused before a byte moves, each naming the fix.

Through the real entry points: `RankReplica.build` (installed SGLang, its Fp8 methods) for rollout settings and
checkpoints, `trainer/fp8_stream.quantized_stream` for write plans whose FP8 tensors the quantizer cannot
produce. And the quantize step itself: FP8 weights and their scales, in stream order, batched.
"""

from __future__ import annotations

import json

import pytest
import torch

from verl_p2p.errors import QuantizationError, UnsupportedLayoutError
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.quant.block_fp8 import BlockFp8Scheme, quantize_block_fp8, scale_name
from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
from verl_p2p.sandbox.tiny import hf_tensor_shapes, tiny_config_dict
from verl_p2p.trainer.fp8_checkpoint import DEFAULT_QUANTIZATION_CONFIG
from verl_p2p.trainer.fp8_stream import quantized_stream

install_cpu_stubs()

from verl_p2p.replica import RankReplica, WritePlanError, plan_cache  # noqa: E402
from verl_p2p.replica.plan_cache import plan_from_json, plan_to_json  # noqa: E402

ARGS = {"tp_size": 2, "ep_size": 2, "dtype": "bfloat16", "device": "cpu"}
WIDE = dict(hidden_size=256, head_dim=128, moe_intermediate_size=512, intermediate_size=512)


def _build(quantization_config=None, args=ARGS, fp8_specs=True, **shape):
    cfg = tiny_config_dict("qwen3_moe", torch_dtype="bfloat16", **(shape or WIDE))
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    specs = {n: (s, torch.bfloat16) for n, s in hf_tensor_shapes(cfg)}
    if fp8_specs:  # the checkpoint's tensors: FP8 weights with their block scales beside them
        scheme = BlockFp8Scheme.from_quantization_config(DEFAULT_QUANTIZATION_CONFIG)
        for name, (shape, _) in list(specs.items()):
            if scheme.quantizes(name, shape):
                specs[name] = (shape, torch.float8_e4m3fn)
                specs[scale_name(name)] = (tuple(-(-d // 128) for d in shape), torch.float32)
    return RankReplica.build(cfg, args, layout_from_server_args(args, 0), specs)


@pytest.mark.parametrize("method", ["fp8", "w8a8_fp8", "modelopt_fp8", "awq", "mxfp4"])
def test_online_quantization_of_a_bf16_checkpoint_is_refused(method):
    with pytest.raises(
        UnsupportedLayoutError,
        match=rf"quantization='{method}' on an unquantized checkpoint.*"
        r"new parameters.*verl_p2p\.trainer\.fp8_checkpoint",
    ):
        _build(args={**ARGS, "quantization": method})


@pytest.mark.parametrize(
    "change, match",
    [
        ({"weight_block_size": None}, r"no weight_block_size \(per-tensor/per-channel FP8\)"),
        ({"weight_block_size": [64, 64]}, r"weight_block_size=\[64, 64\]: the quantizer writes \[128, 128\]"),
        ({"activation_scheme": "static"}, r"activation_scheme='static': static activation scales"),
        ({"scale_fmt": "ue8m0"}, r"keys \['scale_fmt'\] may change the weight bytes"),
        ({"fmt": "e5m2"}, r"fmt='e5m2': only e4m3"),
        ({"quant_method": "compressed-tensors"}, r"quant_method='compressed-tensors'"),
    ],
)
def test_checkpoint_quantization_the_quantizer_cannot_reproduce_is_refused(change, match):
    qc = {k: v for k, v in {**DEFAULT_QUANTIZATION_CONFIG, **change}.items() if v is not None}
    with pytest.raises(UnsupportedLayoutError, match=r"cannot be reproduced: .*" + match + r".*fp8_checkpoint"):
        _build(qc)


def test_other_online_method_on_a_block_fp8_checkpoint_is_refused():
    with pytest.raises(UnsupportedLayoutError, match=r"quantization='w8a8_fp8' on a block-FP8 checkpoint"):
        _build(DEFAULT_QUANTIZATION_CONFIG, args={**ARGS, "quantization": "w8a8_fp8"})


def test_block_that_does_not_divide_the_rank_shard_is_refused():
    """hidden 64: the qkv shards (32/16/16 rows at TP2) are not multiples of 128; SGLang's own rule decides."""
    with pytest.raises(UnsupportedLayoutError, match=r"not divisible by.*SGLang's rule.*Fix: a tp_size"):
        _build(DEFAULT_QUANTIZATION_CONFIG, hidden_size=64, head_dim=16, moe_intermediate_size=32)
    assert torch.get_default_dtype() == torch.float32  # the failed build left torch's default dtype alone


def test_rocm_fnuz_is_refused(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.3", raising=False)
    with pytest.raises(QuantizationError, match=r"ROCm: SGLang normalises e4m3fn weights to e4m3fnuz"):
        _build(DEFAULT_QUANTIZATION_CONFIG)


def test_blackwell_ue8m0_scales_are_refused(monkeypatch):
    from sglang.srt.layers import deep_gemm_wrapper

    monkeypatch.setattr(deep_gemm_wrapper, "DEEPGEMM_SCALE_UE8M0", True)
    with pytest.raises(QuantizationError, match=r"Blackwell.*UE8M0.*Hopper \(sm90\)"):
        _build(DEFAULT_QUANTIZATION_CONFIG)


def test_a_block_fp8_rollout_builds_with_fp8_parameters():
    """The accepted case, for contrast: the rank's plan holds e4m3fn weights and their fp32 block scales."""
    replica = _build(DEFAULT_QUANTIZATION_CONFIG)
    params = replica.plan.params
    assert params["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    assert params["model.layers.0.mlp.experts.w13_weight_scale_inv"].dtype == torch.float32
    assert params["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert params["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].feeds == tuple(
        f"model.layers.0.self_attn.{x}_proj.weight_scale_inv" for x in "qkv"
    )
    # the plan cache stores and restores FP8 plans as they are; the quant-config module is part of its code key
    assert plan_from_json(json.loads(json.dumps(plan_to_json(replica.plan)))) == replica.plan
    assert "fp8.py" in plan_cache._CAPTURE_CODE


def test_a_checkpoint_without_the_scales_is_refused():
    """An FP8 config over a checkpoint whose tensors lack `weight_scale_inv`: the plan leaves the scales unwritten."""
    with pytest.raises(WritePlanError, match=r"qkv_proj\.weight_scale_inv: no checkpoint tensor overwrites it"):
        _build(DEFAULT_QUANTIZATION_CONFIG, fp8_specs=False)


# ------------------------------------------------------------------------------------------ the quantize step

W = "model.layers.0.self_attn.q_proj.weight"


def test_quantize_step_emits_weights_then_scales_in_stream_order():
    planned = {
        W: ((256, 130), torch.float8_e4m3fn),
        W + "_scale_inv": ((2, 2), torch.float32),
        "model.layers.0.self_attn.k_proj.weight": ((256, 130), torch.float8_e4m3fn),
        "model.layers.0.self_attn.k_proj.weight_scale_inv": ((2, 2), torch.float32),
        "model.norm.weight": ((130,), torch.bfloat16),
    }
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(256, 130, generator=gen).to(torch.bfloat16)
    k = torch.randn(256, 130, generator=gen).to(torch.bfloat16)
    norm = torch.ones(130, dtype=torch.bfloat16)
    out = list(
        quantized_stream([(W, q), ("model.layers.0.self_attn.k_proj.weight", k), ("model.norm.weight", norm)], planned)
    )
    assert [n for n, _ in out] == [
        W,
        W + "_scale_inv",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.k_proj.weight_scale_inv",
        "model.norm.weight",
    ]
    wq, ws = quantize_block_fp8(q)
    assert torch.equal(out[0][1].view(torch.uint8), wq.view(torch.uint8)) and torch.equal(out[1][1], ws)
    assert out[4][1] is norm


def test_quantize_step_refuses_a_non_finite_weight_when_the_stream_ends_naming_it():
    """The stream does not wait for the device per batch: a NaN weight is refused at its end, before the push it
    feeds can report success, with the quantizer's message."""
    planned = {
        W: ((256, 130), torch.float8_e4m3fn),
        W + "_scale_inv": ((2, 2), torch.float32),
        "model.norm.weight": ((130,), torch.bfloat16),
    }
    q = torch.ones(256, 130, dtype=torch.bfloat16)
    q[7, 100] = float("nan")
    stream = quantized_stream([(W, q), ("model.norm.weight", torch.ones(130, dtype=torch.bfloat16))], planned)
    got = []
    with pytest.raises(QuantizationError, match=r"q_proj\.weight: 1 NaN/inf value\(s\).*diverged"):
        for name, _ in stream:
            got.append(name)
    assert got == [W, W + "_scale_inv", "model.norm.weight"]  # raised after the last item, not silently done


def test_quantize_step_refuses_fp8_weights_without_block_scales():
    planned = {W: ((256, 130), torch.float8_e4m3fn), W + "_scale_inv": ((1, 1), torch.float32)}
    with pytest.raises(QuantizationError, match=r"not fp32 \(2, 2\) \(one per 128x128 block\).*fp8_checkpoint"):
        quantized_stream(iter(()), planned)  # refused at the call, before anything streams
    with pytest.raises(QuantizationError, match="with scales .*=None"):
        quantized_stream(iter(()), {W: ((256, 130), torch.float8_e4m3fn)})


def test_rollout_model_path_option_is_validated():
    from verl_p2p.config import P2PConfig
    from verl_p2p.errors import P2PConfigError

    assert P2PConfig.from_mapping({"rollout_model_path": "/ckpt/fp8"}).rollout_model_path == "/ckpt/fp8"
    assert P2PConfig().rollout_model_path is None
    with pytest.raises(P2PConfigError, match=r"rollout_model_path='' \(an HF checkpoint directory, or null\)"):
        P2PConfig.from_mapping({"rollout_model_path": ""})


def test_plan_fp8_targets_are_computed_once_per_plan_and_dropped_with_it(monkeypatch):
    """Every push asks for the FP8 targets of its plans; they are walked once per plan object (a plan is
    immutable) and forgotten when the plan is, and a plan that takes no weak reference is walked each time."""
    import gc

    import verl_p2p.trainer.fp8_stream as fs
    from verl_p2p.replica.plan import WritePlan

    scale = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    specs = {W: ((256, 130), torch.float8_e4m3fn), scale: ((2, 2), torch.float32)}
    walks = []
    real = fs.fp8_targets
    monkeypatch.setattr(fs, "fp8_targets", lambda planned: walks.append(1) or real(planned))
    plan = WritePlan(params={}, hf_specs=specs)
    first = fs.plan_fp8_targets([plan])
    assert first == {W: scale} == fs.plan_fp8_targets([plan])
    assert len(walks) == 1
    key = id(plan)
    del plan
    gc.collect()
    assert key not in fs._PLAN_TARGETS

    class Slotted:
        __slots__ = ("hf_specs",)

    bare = Slotted()
    bare.hf_specs = specs
    assert fs.plan_fp8_targets([bare]) == first == fs.plan_fp8_targets([bare])
    assert len(walks) == 3

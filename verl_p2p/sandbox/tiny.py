"""Tiny HF checkpoints (Qwen2, Qwen3, Qwen3-MoE, Llama, DeepSeek-V3, GLM-4.5, GLM-4.7-Flash) for the demo,
the tests and the benchmark.

Nothing is downloaded: configs are built in code and tensors generated. `id_encoded=True` gives every
element of every tensor a distinct integer value (exact in float32 below 2**24), so a misplaced, missing or
doubled byte in a rollout rank shows up as a wrong number.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from verl_p2p.planning.hf_names import hf_tensor_specs

ARCHS = (
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "llama",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "glm4_moe_lite",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
)

_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
_MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)
# DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3; Kimi-K2 is the same class) at tiny sizes: MLA
# with q and kv LoRA ranks and split rope/nope head dims, dense first layers (first_k_dense_replace), routed
# experts with one shared expert, grouped sigmoid routing with a correction bias, and one multi-token-prediction
# layer that the checkpoint written here leaves out (SGLang's main model skips it; its draft loads it).
_DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    num_hidden_layers=3,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    # kv_lora_rank + qk_rope_head_dim = 288: SGLang's triton MLA decode kernel reads V out of the K tile, so the
    # latent and rope widths must be one of its handled pairs (576 as published, or 288); 32 + 16 fails to compile
    kv_lora_rank=256,
    q_lora_rank=48,
    qk_rope_head_dim=32,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    num_nextn_predict_layers=1,
    hidden_act="silu",
    # YaRN as published (factor 40 over 4096 positions), scaled to the tiny context
    rope_scaling=dict(
        type="yarn",
        factor=4.0,
        original_max_position_embeddings=128,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)

# DeepSeek-V2-Lite's published config.json (deepseek-ai/DeepSeek-V2-Lite): MLA without a q LoRA (q_proj), two
# shared experts, greedy softmax routing without a correction bias, no MTP layer.
_DEEPSEEK_V2 = dict(
    _DEEPSEEK_V3,
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    q_lora_rank=None,
    n_shared_experts=2,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    scoring_func="softmax",
    topk_method="greedy",
    num_nextn_predict_layers=0,
)
# GLM-4.5's published config.json (zai-org/GLM-4.5; GLM-4.5-Air has the same structure) at tiny sizes: GQA
# with qkv bias and partial rotary, dense first layers, routed experts with one shared expert, sigmoid routing
# with a correction bias, one MTP layer the checkpoint written here leaves out.
_GLM4_MOE = dict(
    architectures=["Glm4MoeForCausalLM"],
    model_type="glm4_moe",
    num_hidden_layers=3,
    attention_bias=True,
    use_qk_norm=False,
    partial_rotary_factor=0.5,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
    hidden_act="silu",
)
# GLM-4.7-Flash (zai-org/GLM-4.7-Flash): DeepSeek-style MLA (q/kv LoRA ranks, rope/nope head dims) on GLM's MoE,
# w_kc / w_vc derived by the same post_load_weights; tiny sizes, MTP layer left out.
_GLM4_MOE_LITE = dict(_DEEPSEEK_V3, architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite")


# Qwen3-Next (Qwen/Qwen3-Next-80B-A3B-Instruct's config.json at tiny sizes): gated-delta-net linear attention with
# full gated attention every 4th layer, 8 routed experts and a gated shared expert on every layer; MTP left out.
_QWEN3_NEXT = dict(
    architectures=["Qwen3NextForCausalLM"],
    model_type="qwen3_next",
    num_hidden_layers=4,
    full_attention_interval=4,
    head_dim=32,
    partial_rotary_factor=0.25,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    hidden_act="silu",
    attention_bias=False,
)

# Qwen3.5's text models (SGLang configs/qwen3_5.py: Qwen3_5TextConfig and Qwen3_5MoeTextConfig, Qwen3NextConfig
# subclasses) at tiny sizes: linear and full attention alternating, gated attention, and the rope_parameters with an
# mrope_section the published configs carry (an empty rope config stops SGLang's rope factory).
_QWEN3_5 = dict(
    architectures=["Qwen3_5ForCausalLM"],
    model_type="qwen3_5_text",
    num_hidden_layers=4,
    full_attention_interval=2,
    layer_types=["linear_attention", "full_attention"] * 2,
    head_dim=32,
    partial_rotary_factor=0.25,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    attn_output_gate=True,
    hidden_act="silu",
    attention_bias=False,
    torch_dtype="bfloat16",
)
_QWEN3_5_MOE = dict(
    _QWEN3_5,
    architectures=["Qwen3_5MoeForCausalLM"],
    model_type="qwen3_5_moe_text",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)


def tiny_config_dict(arch: str, **overrides) -> dict:
    """The config.json content of a tiny model of `arch`; `overrides` replace any field."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {ARCHS}")
    cfg = dict(_BASE)
    if arch == "qwen2":
        cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
        cfg.pop("head_dim")
    elif arch == "qwen3":
        cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    elif arch == "llama":
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, hidden_act="silu")
    elif arch == "deepseek_v2":
        cfg.pop("head_dim")
        cfg.update(_DEEPSEEK_V2)
    elif arch == "deepseek_v3":
        cfg.pop("head_dim")
        cfg.update(_DEEPSEEK_V3)
    elif arch == "glm4_moe":
        cfg.update(_GLM4_MOE)
    elif arch == "glm4_moe_lite":
        cfg.pop("head_dim")
        cfg.update(_GLM4_MOE_LITE)
    elif arch == "qwen3_next":
        cfg.update(_QWEN3_NEXT)
    elif arch == "qwen3_5":
        cfg.update(_QWEN3_5)
    elif arch == "qwen3_5_moe":
        cfg.update(_QWEN3_5_MOE)
    else:
        cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", mlp_only_layers=[], **_MOE)
    cfg.update(overrides)
    return cfg


def hf_tensor_shapes(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Checkpoint names and shapes, in checkpoint order, with per-expert MoE names (what SGLang loads)."""
    for name, shape, _ in hf_tensor_specs(cfg):
        yield name, shape


def tiny_state_dict(
    cfg: dict, id_encoded: bool = True, seed: int = 0, dtype=torch.float32, init: str = "small"
) -> dict[str, torch.Tensor]:
    """HF-named tensors for `cfg`: id-encoded (distinct integers) or random values. Random `init`: "small" is
    N(0, 0.02) everywhere (a layout test needs distinct values, not a working model); "model" is as a model is
    initialised (norms 1, embeddings N(0, 1) or N(0, 1/hidden) when tied, other matrices N(0, 1/fan_in)), so every
    layer shapes the output:
    with "small" the residual stream is the embedding and greedy tokens ignore attention and the experts (a tiny
    DeepSeek-V3 gave the same tokens for every weight set), which would make a generation check prove nothing."""
    if init not in ("small", "model"):
        raise ValueError(f"init={init!r}: choose 'small' or 'model'")
    out: dict[str, torch.Tensor] = {}
    next_id = 1
    gen = torch.Generator().manual_seed(seed)
    for name, shape in hf_tensor_shapes(cfg):
        numel = 1
        for d in shape:
            numel *= d
        if id_encoded:
            if next_id + numel >= 2**24:
                raise ValueError("tiny model too large for exact float32 id encoding")
            t = torch.arange(next_id, next_id + numel, dtype=torch.float32).reshape(shape)
            next_id += numel
        else:
            unit = torch.randn(shape, generator=gen, dtype=torch.float32)
            t = unit * 0.02 if init == "small" else _model_init(name, unit, bool(cfg.get("tie_word_embeddings")))
        out[name] = t.to(dtype)
    return out


def _model_init(name: str, unit: torch.Tensor, tied: bool = False) -> torch.Tensor:
    """`unit` (N(0, 1) values) scaled as a model initialises tensor `name`. Tied embeddings (the LM head is the
    embedding) are N(0, 1/hidden): at N(0, 1) a token's logit would be dominated by its own embedding's squared
    norm in the residual stream, so the model would only repeat its last input token (seen at Qwen3-4B's shape)."""
    if name.endswith("norm.weight"):  # every RMSNorm / LayerNorm weight (input_layernorm, q_a_layernorm, model.norm)
        return torch.ones_like(unit)
    if unit.dim() == 2 and ("embed_tokens" not in name or tied):
        return unit / unit.shape[-1] ** 0.5
    if unit.dim() == 2:
        return unit
    return unit * 0.02  # biases, routing correction biases


def write_tiny_checkpoint(
    path: str | os.PathLike,
    arch: str,
    id_encoded: bool = True,
    seed: int = 0,
    dtype=torch.float32,
    init: str = "small",
    **overrides,
) -> Path:
    """Write config.json + model.safetensors of a tiny `arch` model to `path` and return it (`init`: see
    `tiny_state_dict`)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config_dict(arch, **overrides)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    tensors = tiny_state_dict(cfg, id_encoded=id_encoded, seed=seed, dtype=dtype, init=init)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return path

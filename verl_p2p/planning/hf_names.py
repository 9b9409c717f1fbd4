"""The tensor list (names, shapes, dtypes, checkpoint order) of a HF checkpoint, derived from its config alone.

A real checkpoint's safetensors headers are the truth (`verl_p2p.trainer.hf_specs`); this is for planning
without one (`verl-p2p plan --model config.json`, the built-in model cards, measurements at real scale).
MoE experts get per-expert names, as published checkpoints and Megatron-Bridge's export carry them.
Pure: no I/O; dtypes are torch dtype names ("bfloat16").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

HFTensorSpec = tuple[str, tuple[int, ...], str]

SUPPORTED_MODEL_TYPES = (
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "llama",
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k2",
    "glm4_moe",
    "glm4_moe_lite",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
)


def config_dtype(cfg: Mapping[str, Any]) -> str:
    """The checkpoint dtype a config names (`torch_dtype`, or transformers 5's `dtype`); float32 when absent."""
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def hf_tensor_specs(cfg: Mapping[str, Any]) -> list[HFTensorSpec]:
    """`[(name, shape, dtype)]` of every tensor the checkpoint of `cfg` holds, in checkpoint order."""
    model_type = cfg.get("model_type")
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "llama"):
        return list(_qwen(cfg, config_dtype(cfg)))
    if model_type in ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite"):  # MLA
        return list(_deepseek_v3(cfg, config_dtype(cfg)))
    if model_type == "glm4_moe":
        return list(_glm4_moe(cfg, config_dtype(cfg)))
    if model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        return list(_gated_delta_net(cfg, config_dtype(cfg)))
    raise ValueError(
        f"no tensor list for model_type={model_type!r} (known: {', '.join(SUPPORTED_MODEL_TYPES)}); "
        "point at a checkpoint directory with *.safetensors instead, whose headers list the tensors"
    )


def _qwen(cfg: Mapping[str, Any], dtype: str) -> Iterator[HFTensorSpec]:
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    moe = cfg["model_type"] == "qwen3_moe"
    yield "model.embed_tokens.weight", (vocab, h), dtype
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), dtype
        yield f"{p}.self_attn.q_proj.weight", (heads * hd, h), dtype
        yield f"{p}.self_attn.k_proj.weight", (kv * hd, h), dtype
        yield f"{p}.self_attn.v_proj.weight", (kv * hd, h), dtype
        if cfg["model_type"] == "qwen2" or (cfg["model_type"] == "llama" and cfg.get("attention_bias")):
            yield f"{p}.self_attn.q_proj.bias", (heads * hd,), dtype
            yield f"{p}.self_attn.k_proj.bias", (kv * hd,), dtype
            yield f"{p}.self_attn.v_proj.bias", (kv * hd,), dtype
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            yield f"{p}.self_attn.q_norm.weight", (hd,), dtype
            yield f"{p}.self_attn.k_norm.weight", (hd,), dtype
        yield f"{p}.self_attn.o_proj.weight", (h, heads * hd), dtype
        yield f"{p}.post_attention_layernorm.weight", (h,), dtype
        step = cfg.get("decoder_sparse_step", 1) or 1
        sparse = moe and i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % step == 0
        if sparse:
            mi = cfg["moe_intermediate_size"]
            yield f"{p}.mlp.gate.weight", (cfg["num_experts"], h), dtype
            for e in range(cfg["num_experts"]):
                yield f"{p}.mlp.experts.{e}.gate_proj.weight", (mi, h), dtype
                yield f"{p}.mlp.experts.{e}.up_proj.weight", (mi, h), dtype
                yield f"{p}.mlp.experts.{e}.down_proj.weight", (h, mi), dtype
        else:
            yield f"{p}.mlp.gate_proj.weight", (inter, h), dtype
            yield f"{p}.mlp.up_proj.weight", (inter, h), dtype
            yield f"{p}.mlp.down_proj.weight", (h, inter), dtype
    yield "model.norm.weight", (h,), dtype
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", (vocab, h), dtype


def _deepseek_v3(cfg: Mapping[str, Any], dtype: str) -> Iterator[HFTensorSpec]:
    """DeepSeek-V3 / Kimi-K2 (MLA attention, shared + routed experts); multi-token-prediction layers left out."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    experts, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    shared = cfg.get("n_shared_experts") or 0
    first_dense, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1) or 1
    yield "model.embed_tokens.weight", (vocab, h), dtype
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), dtype
        if q_lora:
            yield f"{p}.self_attn.q_a_proj.weight", (q_lora, h), dtype
            yield f"{p}.self_attn.q_a_layernorm.weight", (q_lora,), dtype
            yield f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora), dtype
        else:
            yield f"{p}.self_attn.q_proj.weight", (heads * (nope + rope), h), dtype
        yield f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, h), dtype
        yield f"{p}.self_attn.kv_a_layernorm.weight", (kv_lora,), dtype
        yield f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v), kv_lora), dtype
        yield f"{p}.self_attn.o_proj.weight", (h, heads * v), dtype
        yield f"{p}.post_attention_layernorm.weight", (h,), dtype
        if i >= first_dense and i % freq == 0:
            yield f"{p}.mlp.gate.weight", (experts, h), dtype
            if cfg.get("topk_method") == "noaux_tc":
                yield f"{p}.mlp.gate.e_score_correction_bias", (experts,), "float32"
            for e in range(experts):
                yield f"{p}.mlp.experts.{e}.gate_proj.weight", (mi, h), dtype
                yield f"{p}.mlp.experts.{e}.up_proj.weight", (mi, h), dtype
                yield f"{p}.mlp.experts.{e}.down_proj.weight", (h, mi), dtype
            if shared:
                yield f"{p}.mlp.shared_experts.gate_proj.weight", (mi * shared, h), dtype
                yield f"{p}.mlp.shared_experts.up_proj.weight", (mi * shared, h), dtype
                yield f"{p}.mlp.shared_experts.down_proj.weight", (h, mi * shared), dtype
        else:
            inter = cfg["intermediate_size"]
            yield f"{p}.mlp.gate_proj.weight", (inter, h), dtype
            yield f"{p}.mlp.up_proj.weight", (inter, h), dtype
            yield f"{p}.mlp.down_proj.weight", (h, inter), dtype
    yield "model.norm.weight", (h,), dtype
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", (vocab, h), dtype


def _glm4_moe(cfg: Mapping[str, Any], dtype: str) -> Iterator[HFTensorSpec]:
    """GLM-4.5 / GLM-4.5-Air (GQA with qkv bias, dense first layers, routed + shared experts); its
    multi-token-prediction layer (index num_hidden_layers) left out, as SGLang's main model skips it."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    experts, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    shared = cfg.get("n_shared_experts") or 0
    yield "model.embed_tokens.weight", (vocab, h), dtype
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), dtype
        yield f"{p}.self_attn.q_proj.weight", (heads * hd, h), dtype
        yield f"{p}.self_attn.k_proj.weight", (kv * hd, h), dtype
        yield f"{p}.self_attn.v_proj.weight", (kv * hd, h), dtype
        if cfg.get("attention_bias", True):
            yield f"{p}.self_attn.q_proj.bias", (heads * hd,), dtype
            yield f"{p}.self_attn.k_proj.bias", (kv * hd,), dtype
            yield f"{p}.self_attn.v_proj.bias", (kv * hd,), dtype
        if cfg.get("use_qk_norm"):
            yield f"{p}.self_attn.q_norm.weight", (hd,), dtype
            yield f"{p}.self_attn.k_norm.weight", (hd,), dtype
        yield f"{p}.self_attn.o_proj.weight", (h, heads * hd), dtype
        yield f"{p}.post_attention_layernorm.weight", (h,), dtype
        if i >= cfg.get("first_k_dense_replace", 0):
            yield f"{p}.mlp.gate.weight", (experts, h), dtype
            yield f"{p}.mlp.gate.e_score_correction_bias", (experts,), "float32"
            for e in range(experts):
                yield f"{p}.mlp.experts.{e}.gate_proj.weight", (mi, h), dtype
                yield f"{p}.mlp.experts.{e}.up_proj.weight", (mi, h), dtype
                yield f"{p}.mlp.experts.{e}.down_proj.weight", (h, mi), dtype
            if shared:
                yield f"{p}.mlp.shared_experts.gate_proj.weight", (mi * shared, h), dtype
                yield f"{p}.mlp.shared_experts.up_proj.weight", (mi * shared, h), dtype
                yield f"{p}.mlp.shared_experts.down_proj.weight", (h, mi * shared), dtype
        else:
            inter = cfg["intermediate_size"]
            yield f"{p}.mlp.gate_proj.weight", (inter, h), dtype
            yield f"{p}.mlp.up_proj.weight", (inter, h), dtype
            yield f"{p}.mlp.down_proj.weight", (h, inter), dtype
    yield "model.norm.weight", (h,), dtype
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", (vocab, h), dtype


def layer_of(hf_name: str) -> int | None:
    """The decoder layer an HF tensor belongs to (`model.layers.<i>.`), None for embeddings, norm and head."""
    parts = hf_name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
        return int(parts[2])
    return None


def pp_stage_of(hf_name: str, num_layers: int, pp: int) -> int:
    """The trainer pipeline stage that exports `hf_name` under Megatron's even layer split: embeddings on the
    first stage, the final norm and the LM head on the last, decoder layer i on stage i // (layers / pp)."""
    if num_layers % pp:
        raise ValueError(
            f"{num_layers} layers do not split evenly over pp={pp} stages (Megatron's default split); "
            f"choose a pp that divides {num_layers}"
        )
    layer = layer_of(hf_name)
    if layer is None:
        return 0 if hf_name.startswith("model.embed_tokens.") else pp - 1
    return layer // (num_layers // pp)


def _gated_delta_net(cfg: Mapping[str, Any], dtype: str) -> Iterator[HFTensorSpec]:
    """Qwen3-Next and the Qwen3.5 text models: gated-delta-net linear attention, full (gated) attention every
    `full_attention_interval`-th layer; Qwen3-Next and Qwen3.5-MoE have routed experts with one gated shared expert
    on every layer, dense Qwen3.5 a plain MLP. Qwen3-Next's checkpoints fuse the linear attention's input
    projections (in_proj_qkvz, in_proj_ba), Qwen3.5's keep them apart. The multi-token-prediction layer left out."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    key_dim, value_dim = k_heads * cfg["linear_key_head_dim"], v_heads * cfg["linear_value_head_dim"]
    fused_in_proj = cfg["model_type"] == "qwen3_next"
    moe = cfg["model_type"] != "qwen3_5_text"
    interval = cfg["full_attention_interval"]
    yield "model.embed_tokens.weight", (vocab, h), dtype
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), dtype
        if (i + 1) % interval == 0:
            yield f"{p}.self_attn.q_proj.weight", (2 * heads * hd, h), dtype  # the query and its output gate
            yield f"{p}.self_attn.k_proj.weight", (kv * hd, h), dtype
            yield f"{p}.self_attn.v_proj.weight", (kv * hd, h), dtype
            yield f"{p}.self_attn.q_norm.weight", (hd,), dtype
            yield f"{p}.self_attn.k_norm.weight", (hd,), dtype
            yield f"{p}.self_attn.o_proj.weight", (h, heads * hd), dtype
        else:
            if fused_in_proj:
                yield f"{p}.linear_attn.in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, h), dtype
                yield f"{p}.linear_attn.in_proj_ba.weight", (2 * v_heads, h), dtype
            else:
                yield f"{p}.linear_attn.in_proj_qkv.weight", (2 * key_dim + value_dim, h), dtype
                yield f"{p}.linear_attn.in_proj_z.weight", (value_dim, h), dtype
                yield f"{p}.linear_attn.in_proj_b.weight", (v_heads, h), dtype
                yield f"{p}.linear_attn.in_proj_a.weight", (v_heads, h), dtype
            yield f"{p}.linear_attn.conv1d.weight", (2 * key_dim + value_dim, 1, cfg["linear_conv_kernel_dim"]), dtype
            yield f"{p}.linear_attn.dt_bias", (v_heads,), dtype
            yield f"{p}.linear_attn.A_log", (v_heads,), dtype
            yield f"{p}.linear_attn.norm.weight", (cfg["linear_value_head_dim"],), dtype
            yield f"{p}.linear_attn.out_proj.weight", (h, value_dim), dtype
        yield f"{p}.post_attention_layernorm.weight", (h,), dtype
        if not moe:
            i_size = cfg["intermediate_size"]
            yield f"{p}.mlp.gate_proj.weight", (i_size, h), dtype
            yield f"{p}.mlp.up_proj.weight", (i_size, h), dtype
            yield f"{p}.mlp.down_proj.weight", (h, i_size), dtype
            continue
        experts, mi, si = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        yield f"{p}.mlp.gate.weight", (experts, h), dtype
        for e in range(experts):
            yield f"{p}.mlp.experts.{e}.gate_proj.weight", (mi, h), dtype
            yield f"{p}.mlp.experts.{e}.up_proj.weight", (mi, h), dtype
            yield f"{p}.mlp.experts.{e}.down_proj.weight", (h, mi), dtype
        yield f"{p}.mlp.shared_expert.gate_proj.weight", (si, h), dtype
        yield f"{p}.mlp.shared_expert.up_proj.weight", (si, h), dtype
        yield f"{p}.mlp.shared_expert.down_proj.weight", (h, si), dtype
        yield f"{p}.mlp.shared_expert_gate.weight", (1, h), dtype
    yield "model.norm.weight", (h,), dtype
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", (vocab, h), dtype

"""The model shapes `verl-p2p e2e` and the soaks write their checkpoints at, by `--size` and model."""

from __future__ import annotations

from typing import Any

from verl_p2p.e2e.real_sizes import REAL_SIZES

# Model shapes. "tiny": the CPU sandbox's (CI, loopback). "gpu": big enough that a push measures bandwidth.
# "4b": Qwen3-4B's shape (tied embeddings, about 8 GB in bf16): a sync of a few GB, where the pause figures show.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    # deepseek_v3 / glm4_moe: the sandbox's tiny DeepSeek-V3 (MLA, dense first layer, shared expert) and GLM-4.5;
    # a post-load (MLA) model needs a rollout with weight-update sessions (SGLang >= 0.5.21), else it is refused
    "tiny": {"qwen3": {}, "qwen3_moe": {}, "deepseek_v3": {}, "glm4_moe": {}},
    "gpu": {
        "qwen3": dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
        ),
        "qwen3_moe": dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            num_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=512,
        ),
    },
}
SIZES["4b"] = {
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    )
}
# "real": the widths p2p exists for (DeepSeek-V3 with a dense and a MoE layer, Qwen3-30B-A3B at 15 layers, which one
# H200 holds beside a fresh server); `real_sizes.py` has the shapes and the memory arithmetic behind the depth
SIZES["real"] = REAL_SIZES


def model_overrides(size: str, arch: str, layers: int | None = None) -> dict[str, Any]:
    """The overrides of the sandbox's tiny config `arch` that `--size size` (and `--layers`) write a checkpoint at:
    the one shape the harness writes and the mem-fraction arithmetic sizes."""
    overrides = SIZES[size][arch]
    return overrides if layers is None else {**overrides, "num_hidden_layers": layers}

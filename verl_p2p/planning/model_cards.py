"""Published model shapes and published weight-sync figures, as data (nothing is downloaded).

The configs repeat the fields of each model's published `config.json` that decide tensor shapes and the
rollout's parameters. They live in the package (not in a test helper) because `verl-p2p plan --model
<card>` plans with them and the measurements capture real-scale write plans from them.

DeepSeek-V3 and Kimi-K2 are published as FP8 block-quantized checkpoints; the cards here are their BF16
shapes (what the trainer holds; `verl-p2p plan --rollout-quant fp8` plans the block-FP8 rollout from them),
without the multi-token-prediction layer. Kimi-K2's card says `model_type: kimi_k2`, a type transformers only knows
through the checkpoint's remote code; its architecture is DeepSeek-V3's, so the card uses `deepseek_v3`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl_p2p.planning.sync_estimate import Parallelism

_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151645,
    decoder_sparse_step=1,
    head_dim=128,
    hidden_act="silu",
    initializer_range=0.02,
    max_position_embeddings=40960,
    mlp_only_layers=[],
    norm_topk_prob=True,
    num_experts=128,
    num_experts_per_tok=8,
    num_key_value_heads=4,
    output_router_logits=False,
    rms_norm_eps=1e-06,
    rope_scaling=None,
    rope_theta=1000000.0,
    router_aux_loss_coef=0.001,
    sliding_window=None,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    use_cache=True,
    use_sliding_window=False,
    vocab_size=151936,
)

QWEN3_30B_A3B = dict(
    _QWEN3_MOE,
    hidden_size=2048,
    intermediate_size=6144,
    max_window_layers=48,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_hidden_layers=48,
)

QWEN3_235B_A22B = dict(
    _QWEN3_MOE,
    hidden_size=4096,
    intermediate_size=12288,
    max_window_layers=94,
    moe_intermediate_size=1536,
    num_attention_heads=64,
    num_hidden_layers=94,
)

_DEEPSEEK_V3_FAMILY = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    attention_bias=False,
    attention_dropout=0.0,
    hidden_act="silu",
    hidden_size=7168,
    initializer_range=0.02,
    intermediate_size=18432,
    kv_lora_rank=512,
    moe_intermediate_size=2048,
    moe_layer_freq=1,
    n_shared_experts=1,
    norm_topk_prob=True,
    num_experts_per_tok=8,
    num_hidden_layers=61,
    num_nextn_predict_layers=0,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    rms_norm_eps=1e-06,
    scoring_func="sigmoid",
    tie_word_embeddings=False,
    topk_method="noaux_tc",
    torch_dtype="bfloat16",
    use_cache=True,
    v_head_dim=128,
)

DEEPSEEK_V3 = dict(
    _DEEPSEEK_V3_FAMILY,
    bos_token_id=0,
    eos_token_id=1,
    first_k_dense_replace=3,
    max_position_embeddings=163840,
    n_group=8,
    n_routed_experts=256,
    num_attention_heads=128,
    num_key_value_heads=128,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    rope_theta=10000,
    routed_scaling_factor=2.5,
    topk_group=4,
    vocab_size=129280,
)

KIMI_K2 = dict(
    _DEEPSEEK_V3_FAMILY,
    bos_token_id=163584,
    eos_token_id=163585,
    first_k_dense_replace=1,
    max_position_embeddings=131072,
    n_group=1,
    n_routed_experts=384,
    num_attention_heads=64,
    num_key_value_heads=64,
    rope_scaling={
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    rope_theta=50000.0,
    routed_scaling_factor=2.827,
    topk_group=1,
    vocab_size=163840,
)

# zai-org/GLM-4.5-Air's config.json (BF16), without its multi-token-prediction layer (index 46).
GLM_45_AIR = dict(
    architectures=["Glm4MoeForCausalLM"],
    model_type="glm4_moe",
    attention_bias=True,
    attention_dropout=0.0,
    eos_token_id=[151329, 151336, 151338],
    first_k_dense_replace=1,
    head_dim=128,
    hidden_act="silu",
    hidden_size=4096,
    initializer_range=0.02,
    intermediate_size=10944,
    max_position_embeddings=131072,
    moe_intermediate_size=1408,
    n_group=1,
    n_routed_experts=128,
    n_shared_experts=1,
    norm_topk_prob=True,
    num_attention_heads=96,
    num_experts_per_tok=8,
    num_hidden_layers=46,
    num_key_value_heads=8,
    num_nextn_predict_layers=1,
    pad_token_id=151329,
    partial_rotary_factor=0.5,
    rms_norm_eps=1e-05,
    rope_scaling=None,
    rope_theta=1000000,
    routed_scaling_factor=1.0,
    tie_word_embeddings=False,
    topk_group=1,
    torch_dtype="bfloat16",
    use_cache=True,
    use_qk_norm=False,
    vocab_size=151552,
)

MODEL_CARDS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3-235b-a22b": QWEN3_235B_A22B,
    "deepseek-v3": DEEPSEEK_V3,
    "kimi-k2": KIMI_K2,
    "glm-4.5-air": GLM_45_AIR,
}


def model_card(name: str, num_hidden_layers: int | None = None) -> dict[str, Any]:
    """A copy of a built-in config; `num_hidden_layers` shortens it (tests keep real widths, fewer layers)."""
    try:
        cfg = dict(MODEL_CARDS[name.lower()])
    except KeyError:
        raise ValueError(f"no built-in model card {name!r}; known: {', '.join(MODEL_CARDS)}") from None
    if num_hidden_layers is not None:
        cfg["num_hidden_layers"] = num_hidden_layers
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = num_hidden_layers
    return cfg


@dataclass(frozen=True)
class PublishedSync:
    """A published weight-sync time and the layouts assumed here to predict the same setting."""

    system: str
    card: str
    seconds: tuple[float, float]  # (low, high); equal when one figure was published
    setting: str  # what the publication states
    trainer: Parallelism  # assumed where the publication does not say
    rollout: Parallelism
    assumed: str  # which parts of the layouts are assumptions

    def figure(self) -> str:
        lo, hi = self.seconds
        return f"{lo:g} s" if lo == hi else f"{lo:g}-{hi:g} s"


PUBLISHED_SYNCS: tuple[PublishedSync, ...] = (
    PublishedSync(
        "NeMo-RL refit",
        "qwen3-30b-a3b",
        (0.48, 0.67),
        "colocated refit on one 8-GPU H100 node (CUDA IPC, no NIC)",
        Parallelism(tp=1, ep=8, dp=8),
        Parallelism(tp=8, ep=8),
        "parallelism of both sides; the published refit is intra-node (no 400 Gb/s NIC on the path)",
    ),
    PublishedSync(
        "NeMo-RL refit",
        "qwen3-235b-a22b",
        (4.6, 4.6),
        "colocated refit, multi-node H100",
        Parallelism(tp=4, pp=2, ep=8, dp=4),
        Parallelism(tp=8, ep=8, engines=4),
        "32 GPUs and the parallelism of both sides",
    ),
    PublishedSync(
        "miles P2P (RDMA)",
        "qwen3-30b-a3b",
        (2.16, 2.16),
        "4 H100 nodes with InfiniBand, trainer and rollout on separate GPUs",
        Parallelism(tp=2, ep=8, dp=8),
        Parallelism(tp=4, ep=4, engines=4),
        "the 16 + 16 GPU split and the parallelism of both sides",
    ),
    PublishedSync(
        "miles P2P (RDMA)",
        "qwen3-235b-a22b",
        (3.16, 3.16),
        "16 H100 nodes with InfiniBand, trainer and rollout on separate GPUs",
        Parallelism(tp=4, pp=2, ep=16, dp=8),
        Parallelism(tp=8, ep=8, engines=8),
        "the 64 + 64 GPU split and the parallelism of both sides",
    ),
    PublishedSync(
        "vLLM sharded RDT (NIXL)",
        "qwen3-235b-a22b",
        (3.2, 3.3),
        "8 trainer + 8 rollout H100 GPUs, sharded weight transfer over NIXL",
        Parallelism(tp=1, ep=8, dp=8),
        Parallelism(tp=8, ep=8),
        "the parallelism of both sides (one 8-GPU node per side)",
    ),
    PublishedSync(
        "verl mooncake backend",
        "qwen3-30b-a3b",
        (5.93, 5.93),
        "2 x 8 H100, ConnectX-7 400 Gb/s InfiniBand, 2 GB buckets",
        Parallelism(tp=1, ep=8, dp=8),
        Parallelism(tp=4, ep=4, engines=2),
        "one node per side and the parallelism of both sides",
    ),
    PublishedSync(
        "Kimi-K2 RDMA WRITE (checkpoint transfer)",
        "kimi-k2",
        (1.3, 1.3),
        "256 training GPUs (BF16) -> 128 inference GPUs (FP8), under 1.3 s",
        Parallelism(tp=8, ep=64, dp=32),
        Parallelism(tp=8, ep=8, dp_attn=8, engines=16),
        "the parallelism of both sides (pp=1: 61 layers split evenly over no other stage count); the published "
        "rollout holds FP8 (about half these bytes)",
    ),
)


def published_for(card: str) -> list[PublishedSync]:
    return [p for p in PUBLISHED_SYNCS if p.card == card]


def card_name_of(cfg: Mapping[str, Any]) -> str | None:
    """The built-in card a config equals in every shape field, if any (to print its published figures)."""
    for name, card in MODEL_CARDS.items():
        if all(cfg.get(k) == v for k, v in card.items() if k not in ("torch_dtype", "use_cache")):
            return name
    return None

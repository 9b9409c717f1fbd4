"""SGLang's block-FP8 shard rule, checked from the HF config before any write plan is captured.

SGLang refuses to build a 128x128 block-quantized projection whose TP shard is not a whole number of blocks
(`validate_fp8_block_shape` in sglang/srt/layers/quantization/fp8_utils.py; the fused MoE's own check for expert
shards). Which projections split over how many ranks is known from the config and the rollout layout: the
attention over tp/dp_attn, a routed expert over tp/ep, the dense MLP over tp (1 with --moe-dense-tp-size 1), the
shared expert over tp (1 with SGLANG_SHARED_EXPERT_TP1=1). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl_p2p.planning.sync_estimate import Parallelism

BLOCK = 128


@dataclass(frozen=True)
class ShardCheck:
    """One projection family: its width along the split dimension and how many ranks split it."""

    what: str
    width: int
    ranks: int
    fix: str

    def problem(self) -> str | None:
        if self.ranks <= 1 or (self.width % self.ranks == 0 and (self.width // self.ranks) % BLOCK == 0):
            return None
        shard = self.width / self.ranks
        return (
            f"{self.what}: {self.width} split over {self.ranks} ranks leaves {shard:g}-wide shards, not a multiple "
            f"of the {BLOCK}-wide FP8 block SGLang requires. Fix: {self.fix}"
        )


def _families(cfg: Mapping[str, Any], rollout: Parallelism) -> list[ShardCheck]:
    cfg = cfg.get("text_config") or cfg
    tp, attn_tp, moe_tp = rollout.tp, rollout.tp // rollout.dp_attn, rollout.tp // rollout.ep
    heads = int(cfg["num_attention_heads"])
    checks = []
    mla = cfg.get("kv_lora_rank") is not None
    attn_fix = "a --rollout tp/dp_attn that keeps a whole number of blocks per rank, or --rollout-quant bf16"
    if mla:
        nope, rope, v = (int(cfg[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        if cfg.get("q_lora_rank") is not None:
            q_b = heads * (nope + rope)
            checks.append(ShardCheck("attention q_b_proj (heads x (nope + rope))", q_b, attn_tp, attn_fix))
        checks.append(ShardCheck("attention kv_b_proj (heads x (nope + v))", heads * (nope + v), attn_tp, attn_fix))
        checks.append(ShardCheck("attention o_proj input (heads x v)", heads * v, attn_tp, attn_fix))
    else:
        hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        kv = int(cfg.get("num_key_value_heads") or heads)
        checks.append(ShardCheck("attention q and o_proj (heads x head_dim)", heads * hd, attn_tp, attn_fix))
        checks.append(ShardCheck("attention k and v (KV heads x head_dim)", kv * hd, min(attn_tp, kv), attn_fix))
    experts = next((cfg[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if cfg.get(k)), None)
    width = cfg.get("moe_intermediate_size")
    if experts and width:
        checks.append(
            ShardCheck(
                "routed expert (moe_intermediate_size)", int(width), moe_tp, "a larger --rollout ep (tp/ep smaller)"
            )
        )
    shared = int(cfg.get("n_shared_experts") or 0)
    if experts and width and shared and rollout.shared_tp != 1:
        checks.append(
            ShardCheck(
                "shared expert (moe_intermediate_size x n_shared_experts)",
                int(width) * shared,
                tp,
                "--rollout ...,shared_tp=1 (SGLANG_SHARED_EXPERT_TP1=1: each rank holds it whole)",
            )
        )
    dense_layers = (
        not experts
        or int(cfg.get("first_k_dense_replace") or 0) > 0
        or bool(cfg.get("mlp_only_layers"))
        or int(cfg.get("decoder_sparse_step") or 1) > 1
    )
    if dense_layers and cfg.get("intermediate_size") and rollout.moe_dense_tp != 1:
        checks.append(
            ShardCheck(
                "dense MLP (intermediate_size)",
                int(cfg["intermediate_size"]),
                tp,
                "--rollout ...,moe_dense_tp=1 (--moe-dense-tp-size 1: each rank holds it whole)"
                if experts
                else "a smaller --rollout tp",
            )
        )
    return checks


def fp8_block_problems(cfg: Mapping[str, Any], rollout: Parallelism) -> list[str]:
    """Why SGLang cannot build this block-FP8 rollout layout (empty: every checked shard is whole blocks)."""
    return [p for c in _families(cfg, rollout) if (p := c.problem()) is not None]

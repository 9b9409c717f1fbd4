"""The divisibility rules SGLang and Megatron enforce when they build a model, checked from the HF config alone.

`verl-p2p plan` captures a rollout rank's write plan with SGLang's own model class; a layout SGLang cannot build
fails there with an assertion deep in a traceback, and a trainer layout Megatron refuses is not caught at all.
These rules run first, so such a layout is refused before anything is captured, with the option, the rule and
the values that work. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from verl_p2p.errors import UnsupportedLayoutError
from verl_p2p.planning.sync_estimate import Parallelism

# Where each rule lives in the sources this project runs against (SGLang 0.5.12 in site-packages, 0.5.21 and
# 0.5.23 in .venv/sglang-0.5.2x/; Megatron-Core in site-packages):
#   attention heads:  sglang/srt/models/qwen3_moe.py:468 (0.5.21: 520, 0.5.23: 506)
#                     `assert self.total_num_heads % attn_tp_size == 0`; MLA: models/deepseek_v2.py:1358
#   KV heads:         sglang/srt/models/qwen3_moe.py:474-478 (0.5.21: 526-530, 0.5.23: 512-516): kv % attn_tp == 0
#                     when kv >= attn_tp, else attn_tp % kv == 0 (each KV head replicated)
#   vocabulary:       sglang/srt/layers/vocab_parallel_embedding.py:294 `divide(num_embeddings_padded, tp_size)`
#                     after padding to 64 (pad_vocab_size, line 54); only the CPU build pads further (line 237-241)
#   experts:          sglang/srt/layers/moe/fused_moe_triton/layer.py:214 `(num_experts - ...) % moe_ep_size == 0`
#   expert width:     same file, line 220 `intermediate_size % self.moe_tp_size == 0` (0.5.21: 407, 0.5.23: 427)
#   Megatron heads:   megatron/core/transformer/transformer_config.py:1323 (heads % tensor_model_parallel_size)
#   Megatron groups:  megatron/core/transformer/transformer_config.py:1338-1341 (query groups a multiple or divisor)
#   Megatron experts: megatron/core/transformer/moe/moe_layer.py:185 `num_moe_experts % ep_size == 0`
#   Megatron vocab:   padded to a multiple of 128 x tp (megatron/bridge/models/gpt_provider.py:267): no rule
VOCAB_PADDING = 64


@dataclass(frozen=True)
class ModelShape:
    """The sizes a parallel layout must divide, read from an HF config."""

    heads: int
    kv_heads: int | None  # None: multi-head latent attention (one latent, no KV-head split)
    vocab: int
    experts: int | None  # routed experts; None: a dense model
    expert_width: int | None  # moe_intermediate_size

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        cfg = cfg.get("text_config") or cfg
        heads = int(cfg["num_attention_heads"])
        mla = cfg.get("kv_lora_rank") is not None
        kv = None if mla else int(cfg.get("num_key_value_heads") or heads)
        experts = next((cfg[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if cfg.get(k)), None)
        width = cfg.get("moe_intermediate_size") if experts else None
        return cls(heads, kv, int(cfg["vocab_size"]), int(experts) if experts else None, int(width) if width else None)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def _kv_fits(kv: int, tp: int) -> bool:
    return kv % tp == 0 or tp % kv == 0


def _values(ok: Callable[[int], bool], upto: int) -> str:
    return ", ".join(str(v) for v in range(1, upto + 1) if ok(v))


def _listing(values: Sequence[int], limit: int = 12) -> str:
    """The first `limit` values, then "..." when there are more."""
    return ", ".join(map(str, values[:limit])) + (", ..." if len(values) > limit else "")


def rollout_problems(shape: ModelShape, rollout: Parallelism) -> list[str]:
    """Why SGLang cannot build this rollout layout (empty: it can)."""
    tp, ep, dp_attn = rollout.tp, rollout.ep, rollout.dp_attn
    problems = []
    if tp % dp_attn:
        problems.append(f"--rollout dp_attn={dp_attn} must divide tp={tp}: {', '.join(map(str, divisors(tp)))}")
        return problems
    attn_tp = tp // dp_attn
    per = f" (attention tp = tp/dp_attn = {attn_tp})" if dp_attn > 1 else ""
    if shape.heads % attn_tp:
        choices = ", ".join(str(d * dp_attn) for d in divisors(shape.heads))
        problems.append(
            f"--rollout tp={tp}: SGLang splits the {shape.heads} attention heads evenly{per}, so tp must be one of "
            f"{choices}"
        )
    elif shape.kv_heads is not None and not _kv_fits(shape.kv_heads, attn_tp):
        choices = ", ".join(str(d * dp_attn) for d in divisors(shape.heads) if _kv_fits(shape.kv_heads, d))
        problems.append(
            f"--rollout tp={tp}: SGLang needs attention tp{per} to divide the {shape.kv_heads} KV heads or be a "
            f"multiple of them (replicated), so tp must be one of {choices}"
        )
    if _padded_vocab(shape.vocab) % tp:
        padded = _padded_vocab(shape.vocab)
        problems.append(
            f"--rollout tp={tp}: SGLang splits the vocabulary ({shape.vocab} padded to {padded}) evenly over tp on "
            f"a GPU, so tp must divide {padded}: {_listing(divisors(padded))}"
        )
    if shape.experts is None:
        if ep != 1:
            problems.append(f"--rollout ep={ep}: the model has no experts; leave ep out (ep=1)")
        return problems
    if shape.experts % ep:
        problems.append(
            f"--rollout ep={ep}: SGLang gives every ep rank the same number of the {shape.experts} experts, so ep "
            f"must be one of {', '.join(map(str, divisors(shape.experts)))}"
        )
    elif tp % ep:
        problems.append(f"--rollout ep={ep} must divide tp={tp}: ep one of {', '.join(map(str, divisors(tp)))}")
    elif shape.expert_width and shape.expert_width % (tp // ep):
        moe_tp = tp // ep
        problems.append(
            f"--rollout tp={tp},ep={ep}: each expert is split over tp/ep = {moe_tp} ranks, which must divide its "
            f"width moe_intermediate_size={shape.expert_width}; tp/ep one of "
            f"{_listing(divisors(shape.expert_width))}"
        )
    return problems


def rollout_tp_choices(shape: ModelShape, rollout: Parallelism) -> list[int]:
    """Every tp that passes all of SGLang's rules with this rollout's ep and dp_attn (attention tp can split the
    heads at most one per rank, so no tp beyond heads x dp_attn can)."""
    top = shape.heads * rollout.dp_attn
    return [v for v in range(1, top + 1) if not rollout_problems(shape, replace(rollout, tp=v))]


def trainer_problems(shape: ModelShape, trainer: Parallelism) -> list[str]:
    """Why Megatron cannot build this trainer layout (empty: it can)."""
    tp, ep = trainer.tp, trainer.ep
    problems = []
    if shape.heads % tp:
        problems.append(
            f"--trainer tp={tp}: Megatron needs tp to divide the {shape.heads} attention heads: "
            f"{', '.join(map(str, divisors(shape.heads)))}"
        )
    elif shape.kv_heads is not None and not _kv_fits(shape.kv_heads, tp):
        problems.append(
            f"--trainer tp={tp}: Megatron needs tp to divide the {shape.kv_heads} query groups (KV heads) or be a "
            f"multiple of them: {_values(lambda v: shape.heads % v == 0 and _kv_fits(shape.kv_heads, v), shape.heads)}"
        )
    if shape.experts is None:
        if ep != 1:
            problems.append(f"--trainer ep={ep}: the model has no experts; leave ep out (ep=1)")
    elif shape.experts % ep:
        problems.append(
            f"--trainer ep={ep}: Megatron needs ep to divide the {shape.experts} experts: "
            f"{', '.join(map(str, divisors(shape.experts)))}"
        )
    return problems


def check_layouts(cfg: Mapping[str, Any], trainer: Parallelism | None, rollouts: Sequence[Parallelism]) -> None:
    """Refuse (UnsupportedLayoutError, every problem named) layouts SGLang or Megatron would not build."""
    shape = ModelShape.from_hf_config(cfg)
    problems = trainer_problems(shape, trainer) if trainer is not None else []
    for rollout in rollouts:
        found = rollout_problems(shape, rollout)
        choices = rollout_tp_choices(shape, rollout) if found else []
        if choices:
            found.append(
                f"--rollout tp values that pass every rule with ep={rollout.ep}, dp_attn={rollout.dp_attn}: "
                + ", ".join(map(str, choices))
            )
        problems += found
    if problems:
        raise UnsupportedLayoutError(
            "this layout cannot be built (refused before any capture):\n  - " + "\n  - ".join(dict.fromkeys(problems))
        )

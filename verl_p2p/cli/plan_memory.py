"""Whether a planned layout fits the GPUs: a rollout rank's weights and a trainer source's staging slots against
`--gpu-mem`, and the nearest rollout layouts that fit when it does not.

A rollout rank holds its weights (the write plan's bytes) and needs room for the KV cache beside them; a trainer
source stages the sync in two transfer slots (`bucket_size_mb` each) beside its training state. A layout whose
weights alone exceed the card is refused (it cannot start), with the layouts of the same GPU count, or the
fewest more, whose ranks hold fewer bytes (planned from their own write plans, not scaled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from verl_p2p.planning.layout_rules import ModelShape, rollout_problems
from verl_p2p.planning.sync_estimate import Parallelism

DEFAULT_GPU = "H100 80GB"
DEFAULT_GPU_MEM_GB = 80.0
# a rank whose weights take more than this share of the card leaves little for SGLang's KV cache
TIGHT_SHARE = 0.9


@dataclass(frozen=True)
class MemoryFit:
    """The bytes one layout puts on a GPU, against the card's."""

    gpu_bytes: int
    rollout_rank_bytes: int  # the largest rollout rank's weights
    staging_bytes: int  # a trainer source's two transfer slots

    @property
    def fits(self) -> bool:
        return self.rollout_rank_bytes <= self.gpu_bytes and self.staging_bytes <= self.gpu_bytes

    @property
    def tight(self) -> bool:
        return self.fits and self.rollout_rank_bytes > TIGHT_SHARE * self.gpu_bytes

    def json(self) -> dict:
        return {
            "gpu_mem_bytes": self.gpu_bytes,
            "rollout_rank_bytes": self.rollout_rank_bytes,
            "trainer_staging_bytes": self.staging_bytes,
            "fits": self.fits,
            "tight": self.tight,
        }


def candidates(cfg: dict, rollout: Parallelism, limit: int = 4) -> list[Parallelism]:
    """Rollout layouts near `rollout` whose ranks hold fewer bytes: ep raised to tp (same GPUs), then tp (and ep,
    dp_attn with it) doubled with half the replicas (the same GPUs where the replicas allow), SGLang's rules kept."""
    shape = ModelShape.from_hf_config(cfg)
    out: list[Parallelism] = []
    if shape.experts and rollout.ep < rollout.tp:
        out.append(replace(rollout, ep=rollout.tp))
    for factor in (2, 4, 8, 16):
        tp = rollout.tp * factor
        ep = min(tp, rollout.ep * factor) if shape.experts else 1
        if shape.experts and shape.experts % ep:
            ep = rollout.ep
        dp_attn = rollout.dp_attn * factor if rollout.dp_attn > 1 else 1
        out.append(replace(rollout, tp=tp, ep=ep, dp_attn=dp_attn, engines=max(1, rollout.engines // factor)))
    return [c for c in out if not rollout_problems(shape, c)][:limit]


def refusal(
    fit: MemoryFit,
    rollout: Parallelism,
    gpu: str,
    nearest: list[tuple[Parallelism, int]],
    gb: Callable[[int], str],
) -> str:
    """The lines that refuse a layout that does not fit, with the nearest that do."""
    lines = [f"--rollout {rollout.describe()} does not fit one {gpu} GPU ({gb(fit.gpu_bytes)}, --gpu-mem):"]
    if fit.rollout_rank_bytes > fit.gpu_bytes:
        lines.append(f"  a rollout rank holds {gb(fit.rollout_rank_bytes)} of weights (from its write plan)")
    if fit.staging_bytes > fit.gpu_bytes:
        lines.append(f"  a trainer source stages {gb(fit.staging_bytes)} (two --bucket-mb slots)")
    fitting = [(c, n) for c, n in nearest if n <= fit.gpu_bytes]
    if fitting:
        lines.append(
            "  Fix: a layout whose ranks fit: "
            + "; ".join(f"--rollout {c.describe()} ({gb(n)} per rank, {c.tp * c.engines} GPUs)" for c, n in fitting)
        )
    else:
        lines.append("  Fix: more rollout GPUs per engine (a larger tp and ep), a larger --gpu-mem card, or FP8")
    return "\n".join(lines)

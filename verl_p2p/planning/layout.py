"""A rollout rank's parallel layout, derived from its SGLang server args (no upstream endpoint publishes it).

Pure: no I/O. docs/protocol.md section 6 gives the arithmetic; a published layout (some SGLang forks serve one)
is preferred and must agree with the derived one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl_p2p.errors import UnsupportedLayoutError


@dataclass(frozen=True)
class RankLayout:
    """Which shard of every parameter family rollout rank `tp_rank` holds."""

    tp_size: int
    tp_rank: int
    attn_tp_size: int
    attn_tp_rank: int
    attn_dp_size: int
    attn_dp_rank: int
    ep_size: int
    moe_ep_rank: int
    moe_tp_size: int
    moe_tp_rank: int
    enable_dp_lm_head: bool = False

    @property
    def key(self) -> tuple:
        """Hashable identity: two ranks with equal keys (and equal server args) hold equal bytes."""
        return (
            self.tp_size,
            self.tp_rank,
            self.attn_tp_size,
            self.attn_dp_size,
            self.ep_size,
            self.moe_tp_size,
            self.enable_dp_lm_head,
        )


_PUBLISHED_FIELDS = (
    "tp_size",
    "tp_rank",
    "attn_tp_size",
    "attn_tp_rank",
    "attn_dp_rank",
    "moe_ep_rank",
    "moe_tp_size",
    "moe_tp_rank",
)


def _int(server_args: Mapping[str, Any], name: str, default: int) -> int:
    value = server_args.get(name)
    return default if value is None else int(value)


def check_reproducible(server_args: Mapping[str, Any]) -> None:
    """Reject rollout settings whose bytes the replica cannot reproduce, naming the setting and the fix."""
    problems = []
    if _int(server_args, "pp_size", 1) != 1:
        problems.append("pp_size > 1 (rollout pipeline parallelism): use tp/ep instead")
    if _int(server_args, "ep_num_redundant_experts", 0) != 0:
        problems.append("ep_num_redundant_experts > 0: the expert-location map is not published; set it to 0")
    if server_args.get("enable_eplb"):
        problems.append("enable_eplb: expert placement changes at run time; turn EPLB off")
    if server_args.get("init_expert_location") not in (None, "trivial"):
        problems.append("init_expert_location is not 'trivial': use the trivial expert placement")
    if _int(server_args, "moe_dp_size", 1) != 1:
        problems.append("moe_dp_size > 1: not supported; set moe_dp_size=1")
    for cp in ("attn_cp_size", "context_parallel_size"):
        if _int(server_args, cp, 1) != 1:
            problems.append(f"{cp} > 1: attention context parallelism is not supported")
    if problems:
        raise UnsupportedLayoutError("p2p cannot reproduce this rollout layout: " + "; ".join(problems))


def layout_from_server_args(
    server_args: Mapping[str, Any], rank: int, published: Mapping[str, Any] | None = None
) -> RankLayout:
    """Layout of rollout rank `rank` from `/server_info`; cross-checked against `published` when given."""
    check_reproducible(server_args)
    tp = _int(server_args, "tp_size", 1)
    ep = _int(server_args, "ep_size", 1)
    dp = _int(server_args, "dp_size", 1)
    # SGLang >= 0.5.22 reports attention DP as `attn_dp_size` (dp_size then counts replicas).
    attn_dp = _int(server_args, "attn_dp_size", 1)
    if attn_dp == 1 and server_args.get("enable_dp_attention"):
        attn_dp = dp
    if not 0 <= rank < tp:
        raise UnsupportedLayoutError(f"rank {rank} is outside tp_size={tp}")
    if tp % attn_dp or tp % ep:
        raise UnsupportedLayoutError(f"tp_size={tp} is not divisible by attention dp={attn_dp} / ep_size={ep}")
    attn_tp = tp // attn_dp
    moe_tp = tp // ep
    layout = RankLayout(
        tp_size=tp,
        tp_rank=rank,
        attn_tp_size=attn_tp,
        attn_tp_rank=rank % attn_tp,
        attn_dp_size=attn_dp,
        attn_dp_rank=rank // attn_tp,
        ep_size=ep,
        moe_ep_rank=rank // moe_tp,
        moe_tp_size=moe_tp,
        moe_tp_rank=rank % moe_tp,
        enable_dp_lm_head=bool(server_args.get("enable_dp_lm_head")) and attn_dp > 1,
    )
    if published:
        disagree = [
            f"{f}: published {published[f]} vs derived {getattr(layout, f)}"
            for f in _PUBLISHED_FIELDS
            if f in published and int(published[f]) != getattr(layout, f)
        ]
        if disagree:
            raise UnsupportedLayoutError(f"rank {rank}: published layout disagrees with server args: {disagree}")
    return layout

"""Plans for a full-tensor source (verl's FSDP / FSDP2 engine): every rank a sender of the whole model.

With FSDP every rank iterates the full HF stream in step (the gathers are collective), so every rank holds
every tensor in turn: there is no stage and no idle rank. Rank `i` of `n` writes part `i` of `n` of every
target (`split_by_bytes` over the target's parameters: disjoint, balanced by bytes, the same on every process),
so all NICs send, each rank converts only its share of each distinct layout, and no byte is written twice.
The result is an ordinary `TransferPlan` (one stage, `parts` set), so the push, the writer and
`left_unknown` work unchanged. `verl-p2p plan` can call `plan_full_stream` / `estimate_full_stream` for FSDP
layouts.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from verl_p2p.planning.plan import SourceRank, TransferPlan
from verl_p2p.planning.sync_estimate import SyncEstimate, estimate_sync
from verl_p2p.planning.targets import TargetRank


def full_stream_sources(world_size: int) -> list[SourceRank]:
    """The FSDP actor's ranks as plan sources: all of them, one stage."""
    if world_size < 1:
        raise ValueError(f"an FSDP actor has at least one rank, not {world_size}")
    return [SourceRank(global_rank=r, pp_stage=0) for r in range(world_size)]


def build_full_stream_plan(sources: Sequence[SourceRank], targets: Sequence[TargetRank]) -> TransferPlan:
    """Every source writes its byte-balanced part of every target (part `i` of `len(sources)` for the `i`-th
    source by rank). With one source it writes every target whole. Sources must all be stage 0."""
    if len(set(targets)) != len(targets):
        raise ValueError("duplicate rollout targets in the plan input")
    ranks = sorted(s.global_rank for s in sources)
    if len(set(ranks)) != len(ranks):
        raise ValueError("duplicate trainer source ranks in the plan input")
    staged = sorted({s.pp_stage for s in sources})
    if staged and staged != [0]:
        raise ValueError(
            f"a full-tensor (FSDP) source has no pipeline stages, but the sources hold stages {staged}: "
            "use build_transfer_plan for a Megatron trainer"
        )
    if targets and not ranks:
        raise ValueError("no trainer source ranks to send from")
    ordered = tuple(sorted(targets))
    count = len(ranks)
    parts = {(r, t): (i, count) for i, r in enumerate(ranks) for t in ordered} if count > 1 else {}
    return TransferPlan(tasks={r: ordered for r in ranks}, stages=dict.fromkeys(ranks, 0), parts=parts)


def plan_full_stream(world_size: int, targets: Sequence[TargetRank]) -> TransferPlan:
    """`verl-p2p plan`'s entry for an FSDP actor of `world_size` ranks."""
    return build_full_stream_plan(full_stream_sources(world_size), targets)


def estimate_full_stream(
    world_size: int,
    targets: Sequence[TargetRank],
    bytes_per_target: Mapping[TargetRank, int],
    layout_keys: Mapping[TargetRank, Hashable],
    **options: Any,
) -> SyncEstimate:
    """`verl-p2p plan`'s estimate for an FSDP actor: `plan_full_stream` through `estimate_sync` (one stage, so
    `bytes_per_target` is each rollout rank's whole bytes; `options` are `estimate_sync`'s keyword options)."""
    transfer = plan_full_stream(world_size, targets)
    by_stage = {t: {0: int(bytes_per_target[t])} for t in targets}
    return estimate_sync(transfer, by_stage, layout_keys, **options)

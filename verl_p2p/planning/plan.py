"""Who writes to whom: trainer source ranks x rollout (engine, rank) targets -> per-source task lists.

Pure and deterministic (same answer on every process, no I/O). Per pipeline stage every target gets
exactly one sender: first one target per sender so all senders work in parallel, then each remaining
target goes to a sender already producing the same bytes (same layout key: it loads them once and writes
them to several engines), else round-robin over the least-loaded senders.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from verl_p2p.planning.targets import TargetRank


@dataclass(frozen=True, order=True)
class SourceRank:
    """A trainer rank that holds one PP stage's weights after the in-stage gather."""

    global_rank: int
    pp_stage: int


@dataclass(frozen=True)
class TransferPlan:
    """`tasks[global_rank]` lists the targets that source writes its stage's bytes to."""

    tasks: Mapping[int, tuple[TargetRank, ...]]
    stages: Mapping[int, int]  # global_rank -> pp stage

    def targets_of(self, global_rank: int) -> tuple[TargetRank, ...]:
        return self.tasks.get(global_rank, ())

    def senders(self) -> list[int]:
        return sorted(r for r, t in self.tasks.items() if t)

    def sender_of(self, target: TargetRank, pp_stage: int) -> int:
        for rank, targets in self.tasks.items():
            if self.stages[rank] == pp_stage and target in targets:
                return rank
        raise KeyError(f"no sender for {target} in stage {pp_stage}")

    def describe(self) -> str:
        lines = []
        for rank in sorted(self.tasks):
            targets = ", ".join(f"e{t.engine}r{t.rank}" for t in self.tasks[rank]) or "(idle)"
            lines.append(f"source {rank} (pp {self.stages[rank]}): {targets}")
        return "\n".join(lines)


def build_transfer_plan(
    sources: Sequence[SourceRank],
    targets: Sequence[TargetRank],
    layout_keys: Mapping[TargetRank, Hashable] | None = None,
) -> TransferPlan:
    """Assign every target exactly one sender per PP stage. `layout_keys` defaults to the rank index."""
    if len(set(targets)) != len(targets):
        raise ValueError("duplicate rollout targets in the plan input")
    if len({s.global_rank for s in sources}) != len(sources):
        raise ValueError("duplicate trainer source ranks in the plan input")
    keys = {t: (layout_keys[t] if layout_keys else t.rank) for t in targets}
    ordered_targets = sorted(targets)
    tasks: dict[int, list[TargetRank]] = {s.global_rank: [] for s in sources}
    stages = {s.global_rank: s.pp_stage for s in sources}
    by_stage: dict[int, list[int]] = {}
    for s in sorted(sources):
        by_stage.setdefault(s.pp_stage, []).append(s.global_rank)
    if targets and not by_stage:
        raise ValueError("no trainer source ranks to send from")

    for senders in by_stage.values():
        produced: dict[int, set[Hashable]] = {r: set() for r in senders}
        for sender, target in zip(senders, ordered_targets, strict=False):
            tasks[sender].append(target)
            produced[sender].add(keys[target])
        cursor = 0
        for target in ordered_targets[len(senders) :]:
            reuse = [r for r in senders if keys[target] in produced[r]]
            if reuse:
                sender = min(reuse, key=lambda r: (len(tasks[r]), r))
            else:
                sender = senders[cursor % len(senders)]
                cursor += 1
            tasks[sender].append(target)
            produced[sender].add(keys[target])
    return TransferPlan(tasks={r: tuple(t) for r, t in tasks.items()}, stages=stages)

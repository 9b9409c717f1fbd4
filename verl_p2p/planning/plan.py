"""Who writes to whom: trainer source ranks x rollout (engine, rank) targets -> per-source task lists.

Pure and deterministic (same answer on every process, no I/O). Per pipeline stage, when the stage has at
most as many source ranks as there are targets, every target gets exactly one sender: first one target per
sender so all senders work in parallel, then each remaining target goes to a sender already producing the
same bytes (same layout key: it loads them once and writes them to several engines), else round-robin over
the least-loaded senders.

When the stage has more source ranks than targets (data-parallel copies of a stage: after Megatron-Bridge's
gather every rank of the stage holds its bytes), each target's parameters are split over
`k = sources // targets` of them (`split`): source `i` writes part `i // targets` of `k` of target
`i % targets`, so every NIC sends. A part is a fixed set of parameter names (`split_by_bytes`: balanced by
bytes), computed once on the driver from what the target published and carried in each sender's assignment
(`backend/topology.py`, which checks the parts disjoint and complete), so no sender's own plan decides it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

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
    # (global_rank, target) -> (part index, part count) where a target's parameters are split over several
    # sources of its stage; absent: the source writes all of the target's bytes of its stage
    parts: Mapping[tuple[int, TargetRank], tuple[int, int]] = field(default_factory=dict)

    def targets_of(self, global_rank: int) -> tuple[TargetRank, ...]:
        return self.tasks.get(global_rank, ())

    def part_of(self, global_rank: int, target: TargetRank) -> tuple[int, int]:
        """(index, count): which of the target's parts this source writes; (0, 1) is all of it."""
        return self.parts.get((global_rank, target), (0, 1))

    def sources_of(self, target: TargetRank) -> list[int]:
        """Every source writing (a part of) `target`, all stages."""
        return sorted(r for r, targets in self.tasks.items() if target in targets)

    def left_unknown(self, failed: Iterable[int]) -> list[TargetRank]:
        """The targets sources `failed` write to: what a failed (or dead) source leaves unknown, and the only
        targets to re-push; the other targets' bytes came from sources that finished."""
        return sorted({t for r in failed for t in self.targets_of(r)})

    def senders(self) -> list[int]:
        return sorted(r for r, t in self.tasks.items() if t)

    def sender_of(self, target: TargetRank, pp_stage: int) -> int:
        """The (first) source writing `target` in `pp_stage`."""
        for rank in sorted(self.tasks):
            if self.stages[rank] == pp_stage and target in self.tasks[rank]:
                return rank
        raise KeyError(f"no sender for {target} in stage {pp_stage}")

    def describe(self) -> str:
        lines = []
        for rank in sorted(self.tasks):
            targets = ", ".join(f"e{t.engine}r{t.rank}{_part_text(self.part_of(rank, t))}" for t in self.tasks[rank])
            lines.append(f"source {rank} (pp {self.stages[rank]}): {targets or '(idle)'}")
        return "\n".join(lines)


def _part_text(part: tuple[int, int]) -> str:
    return "" if part[1] == 1 else f" part {part[0] + 1}/{part[1]}"


def split_by_bytes(sizes: Iterable[tuple[str, int]], count: int) -> list[frozenset[str]]:
    """`count` disjoint sets of names covering `sizes` ((name, nbytes) pairs), balanced by bytes: largest first
    onto the lightest part (ties: the lower part). Deterministic: every process computes the same parts."""
    if count < 1:
        raise ValueError(f"cannot split into {count} parts")
    loads = [0] * count
    parts: list[set[str]] = [set() for _ in range(count)]
    for name, nbytes in sorted(sizes, key=lambda item: (-int(item[1]), item[0])):
        lightest = min(range(count), key=lambda i: (loads[i], i))
        parts[lightest].add(name)
        loads[lightest] += int(nbytes)
    return [frozenset(p) for p in parts]


def build_transfer_plan(
    sources: Sequence[SourceRank],
    targets: Sequence[TargetRank],
    layout_keys: Mapping[TargetRank, Hashable] | None = None,
    split: bool = True,
) -> TransferPlan:
    """Assign every target its senders per PP stage: one, or (`split`, more sources than targets in the stage)
    `sources // targets` each writing one part. `layout_keys` defaults to the rank index."""
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

    parts: dict[tuple[int, TargetRank], tuple[int, int]] = {}
    for senders in by_stage.values():
        count = len(senders) // len(ordered_targets) if ordered_targets else 1
        if split and count > 1:
            for i, sender in enumerate(senders[: count * len(ordered_targets)]):
                target = ordered_targets[i % len(ordered_targets)]
                tasks[sender].append(target)
                parts[(sender, target)] = (i // len(ordered_targets), count)
            continue
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
    return TransferPlan(tasks={r: tuple(t) for r, t in tasks.items()}, stages=stages, parts=parts)

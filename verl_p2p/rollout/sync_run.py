"""One sync's bookkeeping (`SyncRun`: step timings, failures, which replicas were released, begun, reset or
left stale) and the small helpers every step module shares."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from typing import Any

from verl_p2p.errors import first_line, unknown_targets_of
from verl_p2p.planning.targets import TargetRank
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.sync_types import Connection, ReplicaFailure


class Stop(Exception):
    """Internal: a forward step failed; go straight to the restoring steps."""


class SyncRun:
    """One sync's bookkeeping: step timings, failures, which replicas were released/begun, the stale ones."""

    def __init__(self, lifecycle: Any, version: str) -> None:
        self.version = version
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.failures: list[ReplicaFailure] = []
        self.cleanup: list[ReplicaFailure] = []
        self.released: list[P2PReplicaAdapter] = []
        self.begun: list[P2PReplicaAdapter] = []
        self.reset: list[P2PReplicaAdapter] = []  # the weights checker's reset_tensors was sent to them
        self.begin_failed: set[int] = set()
        self.metrics: dict[str, Any] = {}
        self.connection: Connection | None = lifecycle._connection
        self.reconnected = False
        self.retried: list[TargetRank] = []
        self.unprepared: set[int] = set()  # restarted engines whose abort/release/begin before a re-push failed
        self.reasons: dict[int, str] = {}  # engine -> why the push left its bytes unknown
        self.stale: dict[int, str] = {}  # engine -> why this sync leaves it paused
        self.paused_at: float | None = None  # when the abort was sent (None: still before the pause)
        self.steps_in_pause: list[str] = []  # the lifecycle's steps from the abort on, in order
        self.replanned_in_pause: str | None = None  # why the plan was redone inside the pause (None: it was not)
        self.probing: asyncio.Future | None = None  # the recheck's rank-info read, started once the abort answered

    async def step(self, name: str, targets: Sequence[P2PReplicaAdapter], action) -> list[ReplicaFailure]:
        """`action` on every target in parallel; the failures, each naming its replica."""
        if not targets:
            return []
        if self.paused_at is not None:
            self.steps_in_pause.append(name)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(action(a) for a in targets), return_exceptions=True)
        self.phases[name] = time.perf_counter() - t0
        return [
            ReplicaFailure(name, a.engine, a.url, r)
            for a, r in zip(targets, results, strict=True)
            if isinstance(r, BaseException)
        ]

    def stop_on(self, found: list[ReplicaFailure]) -> None:
        if found:
            self.failures.extend(found)
            raise Stop

    def note_unknown(self, targets: Iterable[TargetRank], what: str) -> None:
        ranks: dict[int, list[int]] = {}
        for t in sorted(targets):
            ranks.setdefault(t.engine, []).append(t.rank)
        for engine, which in ranks.items():
            self.reasons[engine] = f"rank(s) {which} not fully written ({what})"

    def mark_stale(self, adapter: P2PReplicaAdapter, reason: str) -> None:
        self.stale.setdefault(adapter.engine, reason)

    def drop(self, live: list[P2PReplicaAdapter], found: list[ReplicaFailure]) -> list[P2PReplicaAdapter]:
        """A step after the push failed on these replicas: they turn stale, the others go on."""
        self.failures += found
        for failure in found:
            self.stale.setdefault(failure.engine, f"{failure.step} failed: {first_line(failure.error)}")
        return [a for a in live if a.engine not in self.stale]


def unknown_after(error: BaseException, connection: Connection) -> set[TargetRank]:
    """The targets a failed push left unknown: those its exception names, else every target it was given."""
    pushed = set(connection.targets)
    named = {t for t in unknown_targets_of(error) or () if t in pushed}
    return named or pushed

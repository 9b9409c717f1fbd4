"""Trainer ranks whose push fails on chosen pushes, for tests/test_sync_failures.py.

Real: the P2PCheckpointEngine of every rank (its hooks and outcome reporting) in its own process (a Ray actor).

Stand-in, named as such: `FlakySessionStandIn` for verl_p2p.trainer.source.SourceSession (through
tests/support/deadline_ranks.py's session stand-in): its push raises a TransferError naming every target of its
assignment (a write that timed out) on the push numbers in `fail_on`, else counts those targets as written (no
Mooncake writes: the rollouts are tests/support/fake_sglang.py). verl's worker group: deadline_ranks'
RayActorGroupStandIn.
"""

from __future__ import annotations

from typing import Any

from support.deadline_ranks import ExportingSessionStandIn, TrainerRankActor
from verl_p2p.errors import TransferError


class FlakySessionStandIn(ExportingSessionStandIn):
    """Stand-in for SourceSession (see the module docstring); `written` lists the targets of each good push."""

    fail_on: frozenset[int] = frozenset()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.written: list[tuple] = []

    def push(self, weights: Any = None) -> dict:
        self.pushes += 1
        targets = tuple(self.applied[-1].targets)
        if self.pushes in self.fail_on:
            names = ", ".join(map(str, targets))
            raise TransferError(f"write to {names} timed out (push {self.pushes})", unknown_targets=targets)
        self.written.append(targets)
        return {"bytes": 100.0 * len(targets), "num_targets": float(len(targets)), "seconds/total": 0.01}


class FlakyRankActor(TrainerRankActor):
    """One trainer rank (a Ray actor) whose session is the flaky stand-in; `fail_on`: its failing push numbers."""

    def __init__(self, rank: int, world: int, options: dict, fail_on: tuple[int, ...] = ()) -> None:
        super().__init__(rank, world, options, None)
        self._flaky(fail_on)

    def reset(self, options: dict, fail_on: tuple[int, ...] = ()) -> bool:  # type: ignore[override]
        super().reset(options, None)
        self._flaky(fail_on)
        return True

    @staticmethod
    def _flaky(fail_on: tuple[int, ...]) -> None:
        import verl_p2p.trainer.source as source

        source.SourceSession = FlakySessionStandIn
        FlakySessionStandIn.fail_on = frozenset(fail_on)

    def written(self) -> list[tuple]:
        session = self.engine._session
        return [] if session is None else list(session.written)

    def pushes(self) -> int:
        session = self.engine._session
        return 0 if session is None else session.pushes

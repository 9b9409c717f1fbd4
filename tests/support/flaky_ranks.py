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
    """Stand-in for SourceSession (see the module docstring); `written` lists the targets of each good push,
    and each good push tells every engine it wrote (`push_urls`: engine -> FakeSGLang url) that it landed, so
    the fake's weights check sees what was written."""

    fail_on: frozenset[int] = frozenset()
    push_urls: dict[int, str] = {}

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
        for engine in sorted({t.engine for t in targets} & set(self.push_urls)):
            _post(self.push_urls[engine] + "/stand_in_push")
        return {"bytes": 100.0 * len(targets), "num_targets": float(len(targets)), "seconds/total": 0.01}


class FlakyRankActor(TrainerRankActor):
    """One trainer rank (a Ray actor) whose session is the flaky stand-in; `fail_on`: its failing push numbers."""

    def __init__(self, rank: int, world: int, options: dict, fail_on: tuple[int, ...] = ()) -> None:
        super().__init__(rank, world, options, None)
        self._flaky(fail_on, {})

    def reset(  # type: ignore[override]
        self, options: dict, fail_on: tuple[int, ...] = (), push_urls: dict[int, str] | None = None
    ) -> bool:
        super().reset(options, None)
        self._flaky(fail_on, push_urls or {})
        return True

    @staticmethod
    def _flaky(fail_on: tuple[int, ...], push_urls: dict[int, str]) -> None:
        import verl_p2p.trainer.source as source

        source.SourceSession = FlakySessionStandIn
        FlakySessionStandIn.fail_on = frozenset(fail_on)
        FlakySessionStandIn.push_urls = dict(push_urls)

    def written(self) -> list[tuple]:
        session = self.engine._session
        return [] if session is None else list(session.written)

    def pushes(self) -> int:
        session = self.engine._session
        return 0 if session is None else session.pushes


def _post(url: str) -> None:
    """A push that the engine refuses (not paused, no session open) fails the push, as a real write would."""
    import json
    import urllib.request

    request = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()
    except urllib.error.HTTPError as exc:
        raise TransferError(f"{url}: {json.loads(exc.read() or b'{}').get('message', exc)}") from exc

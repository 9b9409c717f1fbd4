"""What a sync is handed and what it reports: the Connection a push writes by, the failures, stale replicas,
SyncError and SyncReport, and the push/prepare callback types (kept apart from the step order in lifecycle.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl_p2p.errors import P2PError
from verl_p2p.planning.layout import RankLayout
from verl_p2p.planning.targets import RemoteRankInfo, TargetRank


@dataclass(frozen=True)
class Connection:
    """What the push needs about every target: rank info and layout per (engine, rank), server args per engine.

    `generation` changes whenever the set of targets or anything about them does (a partial one has its own)."""

    generation: int
    server_infos: Mapping[int, Mapping[str, Any]]
    rank_infos: Mapping[TargetRank, RemoteRankInfo]
    layouts: Mapping[TargetRank, RankLayout]
    changed_engines: frozenset[int] = frozenset()  # engines new or changed since the previous generation
    removed_engines: frozenset[int] = frozenset()
    partial: bool = False  # a re-push after a failed push: only the targets it left unknown

    @property
    def engines(self) -> list[int]:
        return sorted(self.server_infos)

    @property
    def targets(self) -> list[TargetRank]:
        return sorted(self.rank_infos)


@dataclass(frozen=True)
class ReplicaFailure:
    """One step that failed on one replica (`engine` None: not one replica's, e.g. the push or the checker)."""

    step: str
    engine: int | None
    url: str | None
    error: BaseException

    def __str__(self) -> str:
        if self.engine is None:  # the error names what failed; SyncError names the step
            return str(self.error)
        return f"{self.step} on engine {self.engine} ({self.url}): {self.error}"


@dataclass(frozen=True)
class StaleReplica:
    """A replica left paused because its weights or its prefix cache are unknown; `reason` says why."""

    engine: int
    url: str
    reason: str

    def __str__(self) -> str:
        return f"engine {self.engine} ({self.url}): {self.reason}"


class SyncError(P2PError):
    """A sync failed: `failures` are the steps that broke it, `cleanup` what failed while restoring, `stale` the
    replicas left paused (never resumed with unknown weights) until a sync rewrites them."""

    def __init__(
        self,
        version: str | None,
        failures: Sequence[ReplicaFailure],
        cleanup: Sequence[ReplicaFailure] = (),
        stale: Sequence[StaleReplica] = (),
    ):
        self.version, self.failures, self.cleanup, self.stale = version, list(failures), list(cleanup), list(stale)
        first = self.failures or self.cleanup
        what = f"weight sync to version {version!r}" if version is not None else "rollout"
        text = f"{what} failed at {first[0].step}: " + "; ".join(map(str, first)) if first else f"{what} failed"
        if self.failures and self.cleanup:
            text += " | while restoring: " + "; ".join(map(str, self.cleanup))
        if self.stale:
            text += " | stale replicas, paused until a sync rewrites them: " + "; ".join(map(str, self.stale))
        super().__init__(text)

    @property
    def stale_engines(self) -> list[int]:
        return [s.engine for s in self.stale]


@dataclass
class SyncReport:
    """Per-step wall seconds (`total`; `paused`: from the abort to the resume; `control_plane` = total minus
    push; `connect` and `prepare` ran before the pause), the push's metrics."""

    version: str
    phases: dict[str, float]
    metrics: dict[str, Any]
    reconnected: bool
    generation: int
    engines_without_sessions: list[int] = field(default_factory=list)
    retried_targets: list[TargetRank] = field(default_factory=list)  # re-pushed after a failed first push
    recovered_engines: list[int] = field(default_factory=list)  # stale before this sync, resumed by it
    steps_in_pause: list[str] = field(default_factory=list)  # the lifecycle's steps from the abort on, in order
    replanned_in_pause: str | None = None  # why the plan was redone inside the pause (None: it was not)


Push = Callable[[Connection], Awaitable[Mapping[str, Any] | None]]
# Everything a push needs that can be done while the rollout still generates (plan, assignments, the trainer's
# replicas, programs, slots, the first-push check), for this Connection; called before the abort every sync
# (it must return at once when it holds the Connection already), again inside the pause only when the rank
# info changed after the abort.
Prepare = Callable[[Connection], Awaitable[None]]

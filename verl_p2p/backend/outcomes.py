"""What the driver reads from each trainer rank's push outcome, and what a re-push may then ask of that rank.

A re-push within a sync plans around a rank only when the rank itself is the problem: it died, it did not answer
in time (its call may still be running), or it failed naming no rollout target (a local failure, or its own
refusal in the export group's go/no-go). A rank whose error names the targets that failed (a write timed out, a
target refused) is a healthy sender: the re-push prefers the other ranks of its stage for those targets and uses
it again where its stage has no other. So is a rank that stopped only because a peer refused the go/no-go.

Targets whose write call may still land are *busy*: every target of a late rank, and those a rank refused because
its own earlier call to them is still in flight. No other rank may write them in this sync: the old call could
land its older bytes over the newer ones after the replica resumed. They stay unknown (paused); the next sync
plans them normally, and the rank holding the call refuses them again until that call returned.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_p2p.backend.topology import blocked_ranks
from verl_p2p.backend.waiting import ray_wrappers
from verl_p2p.errors import LateError, PushError, error_chain, in_flight_targets_of, unknown_targets_of


class Kind(enum.Enum):
    OK = "ok"
    TARGETS_FAILED = "targets_failed"  # alive; its error names the rollout targets that failed
    STOPPED = "stopped"  # alive; its export group's go/no-go stopped it for a peer's refusal (nothing written)
    FAILED = "failed"  # alive, but failed naming no target (or refused the go/no-go itself)
    DIED = "died"  # its actor is gone: no call of it runs any more
    LATE = "late"  # no answer within the deadline: its call may still be running, and writing


@dataclass(frozen=True)
class RankOutcome:
    """One trainer rank's push outcome as the driver classifies it.

    `unknown`: the targets its push left unknown. `busy`: those a write call of this rank may still land in.
    """

    rank: int
    kind: Kind
    error: BaseException | None = None
    unknown: frozenset = frozenset()
    busy: frozenset = frozenset()

    @property
    def planned_around(self) -> bool:
        """A re-push gives it an idle assignment and does not wait for it."""
        return self.kind in (Kind.FAILED, Kind.DIED, Kind.LATE)

    @property
    def gone(self) -> bool:
        """It cannot take part in a collective of a re-push (dead, or still inside its late call)."""
        return self.kind in (Kind.DIED, Kind.LATE)


def classify(rank: int, outcome: Any, assigned: Iterable[Any]) -> RankOutcome:
    """`outcome`: the rank's push result or its exception (as Ray delivers it: a RayTaskError wrapping it, or a
    LateError from `waiting.wait_each`); `assigned`: the targets of its assignment in that push."""
    if not isinstance(outcome, BaseException):
        return RankOutcome(rank, Kind.OK)
    assigned = frozenset(assigned)
    chain = error_chain(outcome)
    if any(isinstance(e, LateError) for e in chain) or _actor(chain, "ActorUnavailableError"):
        return RankOutcome(rank, Kind.LATE, outcome, assigned, assigned)
    if _actor(chain, "RayActorError"):
        return RankOutcome(rank, Kind.DIED, outcome, assigned)
    aborted = _aborted(chain)
    if aborted is not None:  # nothing exported anywhere in its group: every target it had is unknown
        if rank not in aborted.failures:
            return RankOutcome(rank, Kind.STOPPED, outcome, assigned)
        kind = Kind.TARGETS_FAILED if _names_targets(error_chain(aborted)[1:]) else Kind.FAILED
        return RankOutcome(rank, kind, outcome, assigned)
    named = unknown_targets_of(outcome)
    unknown = assigned if named is None else named
    kind = Kind.TARGETS_FAILED if _names_targets(chain) else Kind.FAILED
    return RankOutcome(rank, kind, outcome, unknown, in_flight_targets_of(outcome))


def unreachable_ranks(outcomes: Mapping[int, RankOutcome]) -> frozenset[int]:
    """The ranks that died or are late: no collective of a re-push may include them (`topology.assign`'s
    `unreachable`)."""
    return frozenset(r for r, o in outcomes.items() if o.gone)


def not_waited_for(sources: Sequence[Any], outcomes: Mapping[int, RankOutcome]) -> frozenset[int]:
    """The ranks a re-push gives nothing and does not wait for: those planned around, and every rank whose export
    runs collectives with an unreachable one (`topology.blocked_ranks`: it may be stuck there too)."""
    around = frozenset(r for r, o in outcomes.items() if o.planned_around)
    return around | blocked_ranks(sources, unreachable_ranks(outcomes))


def repush_exclusions(sources: Sequence[Any], outcomes: Mapping[int, RankOutcome]) -> frozenset[int]:
    """The trainer ranks a re-push gives idle assignments: those not waited for, and every rank whose targets
    failed where its stage keeps another sender (a failed write may be this rank's own endpoint; the others'
    are known good). `sources`: SourceMeta of every rank."""
    hard = not_waited_for(sources, outcomes)
    soft = {r for r, o in outcomes.items() if o.kind is Kind.TARGETS_FAILED}
    out = set(hard)
    for stage in {s.pp_stage for s in sources}:
        ranks = {s.rank for s in sources if s.pp_stage == stage}
        if ranks - hard - soft:
            out |= ranks & soft
    return frozenset(out)


def _names_targets(chain: Sequence[BaseException]) -> bool:
    """Whether the rank's own error names the targets that failed: an error in the chain other than the wrappers
    (the PushError a rank reports its outcome in, which names all its targets when its cause named none, and Ray's
    RayTaskError); where nothing but the wrappers arrived, their list counts."""
    own = [e for e in chain if not isinstance(e, (PushError, *ray_wrappers()))]
    return any(isinstance(getattr(e, "unknown_targets", None), frozenset) for e in own or chain)


def _aborted(chain: Sequence[BaseException]) -> Any:
    from verl_p2p.trainer.senders import ExportAbortedError

    return next((e for e in chain if isinstance(e, ExportAbortedError)), None)


def _actor(chain: Sequence[BaseException], name: str) -> bool:
    """Whether Ray reported the rank's actor as `name` (RayActorError: gone; ActorUnavailableError: unreachable
    for now, its call may still run)."""
    try:
        from ray import exceptions
    except ImportError:  # pragma: no cover - the driver runs under Ray
        return False
    cls = getattr(exceptions, name, None)
    return cls is not None and any(isinstance(e, cls) for e in chain)

"""What the training job sees when a weight sync fails: retry, ride out, or stop (`p2p_max_consecutive_failures`).

verl's trainer loops (one_step_off, fully_async, v1 separate_async) call `update_weights` once per step and let
any exception end the run. A transient failure (a write timeout, a server briefly unreachable) should not: the
sync is tried again, and only the N-th failed sync in a row stops the run, with one error naming the last
failure, the count, the option and the fix.

When the retry runs depends on what the failed sync left behind. A replica left paused (its bytes unknown, or
a resume that failed) blocks every loop: verl's request balancer does not know the pause, SGLang holds requests
to a paused server until it resumes, and one_step_off's next batch waits for all of its requests. So a paused
replica is re-pushed at once, inside the same `update_weights` call. A sync that failed before anything was
written, every replica resumed with the version it held, is retried by the next step's sync instead: the run
goes on one version behind, and the metrics say so. The first sync of a run is never deferred (the rollout
still holds its launch checkpoint, and the weights checker's first compare needs it). A failed sync naming a
trainer rank that died or missed its deadline stops the run at once: verl's next training call would fail on it or
queue behind it. (Where a data-parallel copy re-pushed that rank's targets, the sync succeeded and nothing
reaches this policy: the job learns of the dead rank from verl's next call to it.)
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ray.exceptions import RayActorError

from verl_p2p.backend.metrics import PREFIX
from verl_p2p.config import OPTIONS
from verl_p2p.errors import LateError
from verl_p2p.rollout.sync_types import SyncError

logger = logging.getLogger(__name__)

OPTION = "p2p_max_consecutive_failures"
RETRY_NOW = "retry_now"  # a replica is paused: sync again inside this update_weights call
DEFER = "defer"  # every replica serves the version it held: the next step's sync retries


class SyncFailuresError(SyncError):
    """The run stops: `count` syncs failed in a row (`limit`: the option), or a trainer rank was lost. Carries the
    last SyncError's failures and stale replicas (still paused, never resumed with unknown weights)."""

    def __init__(self, last: SyncError, count: int, limit: int, text: str):
        super().__init__(last.version, last.failures, last.cleanup, last.stale)
        self.count, self.limit = count, limit
        self.args = (text,)


@dataclass
class SyncFailurePolicy:
    """Counts failed syncs in a row and decides, per failure, whether to retry now, defer to the next step, or
    stop the run (raises SyncFailuresError)."""

    limit: int
    consecutive: int = 0  # failed syncs since the last one that completed
    synced: bool = False  # a sync completed: the replicas hold a version the trainer pushed

    def decide(self, error: SyncError) -> str:
        """RETRY_NOW or DEFER after `error`; raises SyncFailuresError when the run must stop."""
        self.consecutive += 1
        lost = lost_trainer_rank(error)
        if lost is not None:
            raise SyncFailuresError(error, self.consecutive, self.limit, _lost_text(error, lost)) from error
        if self.consecutive >= self.limit:
            raise SyncFailuresError(error, self.consecutive, self.limit, _limit_text(error, self)) from error
        if self.synced and not error.stale and not error.cleanup:
            return DEFER
        return RETRY_NOW

    async def run(self, attempt: Callable[[], Awaitable[dict]]) -> dict:
        """`attempt` (one sync) until it completes or the policy defers or stops; the metrics say what happened:
        `sync_failed` (1: no sync completed, the next step retries), `failed_attempts` (in this call) and
        `consecutive_failures` (0 once a sync completed)."""
        failed = 0
        while True:
            try:
                metrics = await attempt()
            except SyncError as error:
                failed += 1
                verdict = self.decide(error)
                if verdict == DEFER:
                    logger.warning(
                        "p2p: weight sync failed (%d in a row, %s=%d); the replicas serve the version they held "
                        "and the next step's sync retries: %s",
                        self.consecutive,
                        OPTION,
                        self.limit,
                        error,
                    )
                    return self._metrics(failed, sync_failed=True)
                logger.warning(
                    "p2p: weight sync failed (%d in a row, %s=%d) leaving replica(s) %s paused: syncing again now "
                    "(a paused replica stalls verl's generation): %s",
                    self.consecutive,
                    OPTION,
                    self.limit,
                    error.stale_engines or "whose resume failed",
                    error,
                )
                continue
            if self.consecutive:
                logger.info("p2p: weight sync completed after %d failed sync(s) in a row", self.consecutive)
            self.consecutive, self.synced = 0, True
            return {**metrics, **self._metrics(failed, sync_failed=False)}

    def _metrics(self, failed: int, sync_failed: bool) -> dict[str, float]:
        return {
            f"{PREFIX}sync_failed": float(sync_failed),
            f"{PREFIX}failed_attempts": float(failed),
            f"{PREFIX}consecutive_failures": float(self.consecutive),
        }


def lost_trainer_rank(error: SyncError) -> BaseException | None:
    """The first dead (Ray's RayActorError) or late (LateError) trainer rank's error behind `error`'s failures."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [f.error for f in error.failures]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, (LateError, RayActorError)):
            return exc
        todo += [getattr(exc, "cause", None), exc.__cause__, exc.__context__]
    return None


def _stale_text(error: SyncError) -> str:
    if not error.stale:
        return ""
    return f" Replicas still paused (never resumed with unknown weights): {error.stale_engines}."


def _limit_text(error: SyncError, policy: SyncFailurePolicy) -> str:
    return (
        f"p2p: {policy.consecutive} weight syncs failed in a row ({OPTION}={policy.limit}): the run stops. "
        f"The last: {error}.{_stale_text(error)} Fix the cause it names (docs/failures.md has each case), or set "
        f"{OPTIONS}.{OPTION} higher to ride out longer outages."
    )


def _lost_text(error: SyncError, lost: BaseException) -> str:
    return (
        f"p2p: a trainer rank died or did not answer within its deadline ({type(lost).__name__}): the run stops at "
        f"once, whatever {OPTION} says (verl's next training call would fail on that rank or queue behind it). The "
        f"sync: {error}.{_stale_text(error)} Fix: find why the rank died or hung (its log), then restart the job "
        "from its last checkpoint."
    )

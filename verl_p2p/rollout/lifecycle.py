"""The sync sequence (docs/architecture.md, "One sync"): the only module that knows the order of the steps.

    [while the rollout still generates: connect (cached) -> prepare (plan, the trainer's replicas, programs,
    slots, first-push check; a no-op when nothing changed)]
    -> abort -> release KV (when the rollout frees it) -> [checker: snapshot + reset, first sync and re-arms]
    -> begin session -> recheck (the rank info re-read, started once the abort was answered and overlapped with
    release KV..begin; changed: re-plan here, logged)
    -> push [-> re-push the targets left unknown, `p2p_push_retries` times]
    -> per replica whose every target got all its bytes: bump version -> end session -> [checker: compare,
       until passed] -> resume KV -> flush prefix cache -> resume generation

Each step runs on every replica in parallel, in lockstep. Before the push nothing is written: a step that fails
on any replica stops the forward steps (the push never runs after a failed begin/connect) and every replica is
restored on its own (end where a begin was sent, resume KV where released, resume generation), replicas in
parallel, so one that hangs (a frozen rank: its end waits out http_timeout) holds back only itself.

From the push on, replicas part ways. A replica is *stale* when its bytes or its cache are unknown: a target of
it the push and its retries did not finish, or a later step (bump, end, compare, resume KV, flush) that failed
on it; also, when a sync fails before its push, every replica the weights checker reset (random weights). A
stale replica is parked (its session ended and its KV resumed where possible, in the background) but NEVER
resumed: real SGLang resumes generation whatever state its weights are in. It is named in the sync's SyncError
and stays stale, paused, across syncs until a sync writes it completely and takes it through every step, which
then resumes it. The others are versioned, flushed and resumed at once. A failed push is retried within the
sync for the targets it left unknown, after re-reading their rank info (a restarted rank publishes a new
session); the retry writes only those targets, and the others wait for it before they resume. An engine whose
rank info changed is a restarted server (generating, no session): it is aborted, KV-released and begun, as on
the normal path, before the retry writes it, or left out of it (stale) when one of those steps fails. SGLang flushes
its prefix cache after the weight updates it performs itself, but one-sided writes bypass its loader: without
the flush, prefixes cached with the old weights would be served after the sync. docs/failures.md has what each
failure leaves behind.

Connect is cached and runs before the pause. Every sync reads each rank's transfer-engine info (one GET per
rank, all in parallel) and compares a digest of the raw answer with the cached one; only a changed digest is
parsed, and only a changed `RemoteRankInfo.fingerprint()` (session id, an address or a size) counts as a change.
Server args are fetched once per engine and again only when its rank info changed (a restarted server) or the
engine was re-added. A failed connect or prepare fails the sync before anything is paused. Inside the pause
the rank info is read once more, started once every abort was answered and overlapped with release KV..begin (the
recheck): a server that restarted after the first read, even just before its abort arrived, is re-planned there,
the reason logged and reported (`SyncReport.replanned_in_pause`), and goes through abort, release KV and begin
again first (the restart may have come after this sync's abort reached it). A change
yields a new `Connection` (a new `generation`, `changed_engines`); otherwise the same object comes back, so the
push side re-plans only on change. A retry's Connection is `partial` (only the targets to re-push) and has a
generation of its own.
`recheck_rank_info=False` skips the per-sync re-reads (then only add/remove_adapters trigger a reconnect).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from verl_p2p.config import P2PConfig
from verl_p2p.errors import first_line
from verl_p2p.planning.targets import TargetRank
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.checker import WeightUpdateChecker
from verl_p2p.rollout.client import RankAnswer
from verl_p2p.rollout.connect_steps import ConnectSteps
from verl_p2p.rollout.repush_steps import RepushSteps
from verl_p2p.rollout.sync_run import Stop, SyncRun
from verl_p2p.rollout.sync_types import (
    Connection,
    Prepare,
    Push,
    ReplicaFailure,
    StaleReplica,
    SyncError,
    SyncReport,
)

__all__ = [
    "Connection",
    "Prepare",
    "Push",
    "ReplicaFailure",
    "StaleReplica",
    "SyncError",
    "SyncLifecycle",
    "SyncReport",
]


logger = logging.getLogger(__name__)


class SyncLifecycle(ConnectSteps, RepushSteps):
    """Runs syncs over a set of replica adapters; keeps the connect cache and the stale replicas between syncs.
    The step order lives here; the connect cache (`connect_steps`) and the push with its re-pushes
    (`repush_steps`) are step sets of their own, mixed in; `sync_run` holds one sync's bookkeeping and
    `sync_types` what a sync is handed and reports.

    `frees_kv`: release/resume the KV cache around the update (verl's `rollout.free_cache_engine`).
    `checker`: the check_weight_update_equal hook; built from `config` when None and the option is on (pass
    one made with `resumed_from_checkpoint=True` when the trainer resumed).
    """

    def __init__(
        self,
        adapters: Iterable[P2PReplicaAdapter],
        config: P2PConfig | None = None,
        *,
        frees_kv: bool = True,
        checker: WeightUpdateChecker | None = None,
        recheck_rank_info: bool = True,
    ):
        self.config = config or P2PConfig()
        self.frees_kv = frees_kv
        if checker is None and self.config.check_weight_update_equal:  # never skip the check silently
            checker = WeightUpdateChecker(self.config)
        self.checker = checker
        self.recheck_rank_info = recheck_rank_info
        self._adapters: dict[int, P2PReplicaAdapter] = {}
        self._answers: dict[int, dict[int, RankAnswer]] = {}  # engine -> rank -> last answer
        self._connection: Connection | None = None
        self._generation = 0  # the last generation handed out (full and partial connections share the count)
        self._stale: dict[int, str] = {}  # engine -> why it is paused until a sync rewrites it
        self._open_sessions: set[int] = set()  # engines whose session may still be open (begun, end not answered)
        self._running = False
        self.add_adapters(adapters)

    @property
    def adapters(self) -> list[P2PReplicaAdapter]:
        return [self._adapters[e] for e in sorted(self._adapters)]

    @property
    def stale(self) -> dict[int, str]:
        """Engines left paused with unknown weights or cache (engine -> reason); the next full sync rewrites them."""
        return dict(self._stale)

    def add_adapters(self, adapters: Iterable[P2PReplicaAdapter]) -> None:
        """Add (or replace, by engine index) replicas; only their cached info is invalidated. A replaced engine
        is a new server: what the old one was left holding no longer matters."""
        for adapter in adapters:
            self._adapters[adapter.engine] = adapter
            self._forget(adapter.engine)
            adapter.forget()

    def remove_adapters(self, engines: Iterable[int | P2PReplicaAdapter]) -> None:
        for item in engines:
            engine = item.engine if isinstance(item, P2PReplicaAdapter) else int(item)
            self._adapters.pop(engine, None)
            self._forget(engine)

    def _forget(self, engine: int) -> None:
        if self.checker is not None:
            self.checker.forget(engine)
        self._answers.pop(engine, None)
        self._stale.pop(engine, None)
        self._open_sessions.discard(engine)

    # ---- sync ----------------------------------------------------------------------------------------------

    async def sync(self, version: Any, push: Push, prepare: Prepare | None = None) -> SyncReport:
        """One weight sync to `version` (the global step); raises SyncError naming every failed replica and
        every replica left stale. `prepare` runs before the abort (see `Prepare`)."""
        if self._running:
            raise RuntimeError("SyncLifecycle.sync is already running: syncs must not overlap")
        self._running = True
        try:
            return await self._sync(str(version), push, prepare)
        finally:
            self._running = False

    async def _sync(self, version: str, push: Push, prepare: Prepare | None = None) -> SyncReport:
        run = SyncRun(self, version)
        adapters = self.adapters
        was_stale = {a.engine for a in adapters if a.engine in self._stale}
        try:
            await self._before_pause(run, adapters, prepare)
        except Stop:  # nothing was paused: the rollout never noticed
            stale = [StaleReplica(a.engine, a.url, self._stale[a.engine]) for a in adapters if a.engine in self._stale]
            raise SyncError(version, run.failures, [], stale) from None
        run.paused_at = time.perf_counter()
        stage = "prepare"
        resumed: list[P2PReplicaAdapter] = []
        try:
            try:
                await self._prepare(run, adapters, prepare)
            except Stop:
                pass
            if not run.failures:
                stage = "push"
                unknown = await self._push_with_retries(run, push)
                stage = "finish"
                resumed = await self._finish(run, adapters, unknown)
                stage = "done"
        finally:
            if run.probing is not None:
                if not run.probing.done():
                    run.probing.cancel()
                await asyncio.wait([run.probing])
            if stage == "prepare":  # nothing was written: restore every replica (the stale ones stay paused)
                await self._restore_all(run, adapters)
            elif stage != "done":  # interrupted (cancelled, or a bug) from the push on: bytes unknown everywhere
                for adapter in adapters:
                    self._stale.setdefault(adapter.engine, f"the sync to version {version!r} was interrupted")
                    run.stale.setdefault(adapter.engine, self._stale[adapter.engine])
        recovered = [a.engine for a in resumed if a.engine in was_stale]
        for engine in recovered:
            logger.info("p2p: engine %d was rewritten completely and resumed", engine)
        run.phases["paused"] = time.perf_counter() - run.paused_at
        run.phases["total"] = time.perf_counter() - run.start
        run.phases["control_plane"] = run.phases["total"] - run.phases.get("push", 0.0)
        stale = [StaleReplica(a.engine, a.url, self._stale[a.engine]) for a in adapters if a.engine in self._stale]
        if run.failures or run.cleanup or stale:
            raise SyncError(version, run.failures, run.cleanup, stale)
        return SyncReport(
            version=version,
            phases=run.phases,
            metrics=run.metrics,
            reconnected=run.reconnected,
            generation=run.connection.generation if run.connection else 0,
            engines_without_sessions=[a.engine for a in adapters if a.sessions_supported is False],
            retried_targets=run.retried,
            recovered_engines=recovered,
            steps_in_pause=list(run.steps_in_pause),
            replanned_in_pause=run.replanned_in_pause,
        )

    # ---- before the pause: everything that does not need it -----------------------------------------------------

    async def _before_pause(self, run: SyncRun, adapters: list[P2PReplicaAdapter], prepare: Prepare | None) -> None:
        """Connect (rank info and server args: cached, re-read) and `prepare` (plan, assignments, the trainer's
        replicas, programs, slots, first-push check) while the rollout still generates; raises Stop when
        either failed (nothing was paused)."""
        t0 = time.perf_counter()
        run.connection, run.reconnected, found = self._assemble(adapters, await self._probe_all(adapters))
        run.phases["connect"] = time.perf_counter() - t0
        run.stop_on(found)
        if prepare is not None:
            await self._run_prepare(run, prepare, "prepare")

    async def _run_prepare(self, run: SyncRun, prepare: Prepare, name: str) -> None:
        t0 = time.perf_counter()
        try:
            await prepare(run.connection)
        except Exception as exc:
            run.stop_on([ReplicaFailure(name, None, None, exc)])
        finally:
            run.phases[name] = time.perf_counter() - t0

    async def _recheck_in_pause(
        self, run: SyncRun, adapters: list[P2PReplicaAdapter], probing: asyncio.Future, prepare: Prepare | None
    ) -> None:
        """The rank info re-read inside the pause (overlapped with release KV..begin). Unchanged (the steady state and
        the first sync alike): nothing to do. Changed (a server restarted after the read before the pause):
        re-plan here, logged with the reason."""
        run.steps_in_pause.append("recheck")
        t0 = time.perf_counter()
        connection, changed, found = self._assemble(adapters, await probing, step="recheck")
        run.phases["recheck"] = time.perf_counter() - t0
        run.stop_on(found)
        if not changed:
            return
        previous, run.connection, run.reconnected = run.connection, connection, True
        run.replanned_in_pause = (
            f"the rank info of engine(s) {sorted(connection.changed_engines)} changed between the read before the "
            "pause and the re-read inside it (a restarted server?)"
        )
        logger.warning("p2p: re-planning inside the pause: %s", run.replanned_in_pause)
        # a server that restarted after the abort reached it is generating and has no session: it goes through
        # the steps again (harmless where the restart came first and the abort and begin reached the new one)
        changed = [a for a in adapters if a.engine in connection.changed_engines]
        _, found = await self._prepare_new_servers(
            run, changed, "restarted, inside the pause", previous, maybe_released=True
        )
        run.stop_on(found)
        if prepare is not None:
            run.steps_in_pause.append("replan_in_pause")
            await self._run_prepare(run, prepare, "replan_in_pause")

    # ---- before the push: all or nothing -----------------------------------------------------------------------

    async def _prepare(self, run: SyncRun, adapters: list[P2PReplicaAdapter], prepare: Prepare | None = None) -> None:
        """abort .. begin, then the rank-info recheck; raises Stop when a step failed on any replica (nothing
        was written). The recheck's read starts once every abort was answered, so a server that restarted
        before its abort arrived is seen by it; it overlaps release KV, the checker's arm and begin."""
        run.stop_on(await run.step("abort", adapters, lambda a: a.pause()))
        run.probing = asyncio.ensure_future(self._probe_all(adapters))
        if self.frees_kv:
            run.released = list(adapters)
            run.stop_on(await run.step("release_kv", adapters, lambda a: a.release_kv()))
        if self.checker is not None and self.checker.wants_arm:
            run.reset = self.checker.arming(adapters)  # reset_tensors randomises them: from here, bytes changed
            run.stop_on(await self._timed_check(run, "check_arm", self.checker.arm, adapters))
        run.begun = list(adapters)
        found = await run.step("begin", adapters, self._begin)
        run.begin_failed = {f.engine for f in found}
        run.stop_on(found)
        await self._recheck_in_pause(run, adapters, run.probing, prepare)

    async def _begin(self, adapter: P2PReplicaAdapter) -> None:
        """Begin the session; first end one an earlier sync could not. A begin that fails may still have opened
        one, so the engine counts as having an open session until its begin says there are none."""
        if adapter.engine in self._open_sessions:
            try:
                await adapter.end_session()
            except Exception as exc:  # most likely it did end meanwhile ("no session is open")
                logger.warning("p2p: closing the session an earlier sync left open on %s: %s", adapter, exc)
            self._open_sessions.discard(adapter.engine)
        if adapter.sessions_supported is not False:
            self._open_sessions.add(adapter.engine)
        if not await adapter.begin_session():
            self._open_sessions.discard(adapter.engine)

    async def _restore_all(self, run: SyncRun, adapters: list[P2PReplicaAdapter]) -> None:
        """After a failure before the push: each replica on its own (end, resume KV, resume unless stale). A
        replica the weights checker reset holds random weights: stale, like a failed push's."""
        for adapter in run.reset:
            self._stale[adapter.engine] = run.stale[adapter.engine] = (
                "check_weight_update_equal randomised its weights (reset_tensors) and the sync failed before "
                "rewriting them"
            )
        run.steps_in_pause.append("restore")
        t0 = time.perf_counter()
        chains = [
            self._restore_one(run, a, a in run.released, resume=a.engine not in self._stale)
            for a in adapters
            if a in run.begun or a in run.released or a.engine not in self._stale
        ]
        for found in await asyncio.gather(*chains):
            run.cleanup += found
        run.phases["restore"] = time.perf_counter() - t0

    async def _restore_one(
        self, run: SyncRun, adapter: P2PReplicaAdapter, resume_kv: bool, resume: bool
    ) -> list[ReplicaFailure]:
        """End (when its session may be open), resume KV (when released), resume (when asked): each step tried."""
        found = []
        steps = [("end", lambda: self._end(adapter))] if adapter.engine in self._open_sessions else []
        steps += [("resume_kv", adapter.resume_kv)] if resume_kv else []
        steps += [("resume", adapter.resume)] if resume else []
        for name, action in steps:
            try:
                await action()
            except Exception as exc:
                failure = ReplicaFailure(name, adapter.engine, adapter.url, exc)
                if name == "end" and adapter.engine in run.begin_failed:  # no session is the likely answer
                    logger.warning("after a failed begin (a session may not be open): %s", failure)
                    self._open_sessions.discard(adapter.engine)
                else:
                    found.append(failure)
        return found

    async def _end(self, adapter: P2PReplicaAdapter) -> None:
        await adapter.end_session()
        self._open_sessions.discard(adapter.engine)

    # ---- after the push: each replica on its own ----------------------------------------------------------------

    async def _finish(self, run: SyncRun, adapters: list[P2PReplicaAdapter], unknown: set[TargetRank]) -> list:
        """Version, end, [compare], resume KV, flush and resume every replica whose targets all completed;
        park the others (end, resume KV; never resume). Returns the replicas resumed."""
        bad = {t.engine for t in unknown}
        good = [a for a in adapters if a.engine not in bad]
        parked = [a for a in adapters if a.engine in bad]
        for adapter in parked:
            self._stale[adapter.engine] = run.stale[adapter.engine] = run.reasons.get(
                adapter.engine, "its bytes are unknown after the push"
            )

        async def forward() -> list[P2PReplicaAdapter]:
            live = list(good)
            live = run.drop(live, await run.step("bump_version", live, lambda a: a.bump_version(run.version)))
            ending = [a for a in live if a.engine in self._open_sessions]
            live = run.drop(live, await run.step("end", ending, self._end))
            if live and self.checker is not None and self.checker.wants_compare:
                found = await self._timed_check(run, "check_compare", self.checker.compare, live)
                for failure in found:
                    engines = getattr(failure.error, "engines", None) or {a.engine for a in live}
                    run.failures.append(failure)
                    for adapter in live:
                        if adapter.engine in engines:
                            run.mark_stale(adapter, f"check_compare failed: {first_line(failure.error)}")
                live = [a for a in live if a.engine not in run.stale]
            released = [a for a in live if a in run.released]
            live = run.drop(live, await run.step("resume_kv", released, lambda a: a.resume_kv()))
            live = run.drop(live, await run.step("flush_cache", live, lambda a: a.flush_cache()))
            found = await run.step("resume", live, lambda a: a.resume())
            run.cleanup += found
            return [a for a in live if a.engine not in {f.engine for f in found}]

        t0 = time.perf_counter()
        resumed, *found = await asyncio.gather(forward(), *(self._park(run, a) for a in parked))
        late = [a for a in good if a.engine in run.stale]  # a step after the push failed on them
        found += await asyncio.gather(*(self._park(run, a) for a in late))
        run.cleanup += [f for failures in found for f in failures]
        for adapter in good:
            if adapter.engine in run.stale:
                self._stale[adapter.engine] = run.stale[adapter.engine]
            else:
                self._stale.pop(adapter.engine, None)
        if parked or late:
            run.phases["park"] = time.perf_counter() - t0
        return resumed

    async def _park(self, run: SyncRun, adapter: P2PReplicaAdapter) -> list[ReplicaFailure]:
        """A stale replica: end its session and resume its KV where possible; generation stays paused."""
        return await self._restore_one(run, adapter, adapter in run.released, resume=False)

    async def _timed_check(self, run: SyncRun, name: str, check, adapters) -> list[ReplicaFailure]:
        run.steps_in_pause.append(name)
        t0 = time.perf_counter()
        try:
            await check(adapters)
            return []
        except Exception as exc:
            return [ReplicaFailure(name, None, None, exc)]  # the checker's message names each replica
        finally:
            run.phases[name] = time.perf_counter() - t0

    def sessionless_engines(self) -> tuple[int, ...]:
        """Engines known or expected to have no weight-update sessions (their begin answered 404, or before the
        first begin their SGLang release predates 0.5.21): what a trainer's plan refuses post-load models for."""
        return tuple(a.engine for a in self.adapters if a.sessions_expected is False)

    def close(self) -> None:
        for adapter in self._adapters.values():
            adapter.close()

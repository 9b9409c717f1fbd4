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
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PError, unknown_targets_of
from verl_p2p.planning.layout import RankLayout, layout_from_server_args
from verl_p2p.planning.targets import RemoteRankInfo, TargetRank
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.checker import WeightUpdateChecker
from verl_p2p.rollout.client import RankAnswer, RolloutCallError

logger = logging.getLogger(__name__)


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


class _Stop(Exception):
    """Internal: a forward step failed; go straight to the restoring steps."""


class SyncLifecycle:
    """Runs syncs over a set of replica adapters; keeps the connect cache and the stale replicas between syncs.

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

    def _next_generation(self) -> int:
        self._generation += 1
        return self._generation

    # ---- connect ---------------------------------------------------------------------------------------------

    async def connect(self) -> Connection:
        """The current Connection: the cached one when nothing changed (see the module docstring)."""
        adapters = self.adapters
        connection, _, failures = self._assemble(adapters, await self._probe_all(adapters))
        if failures:
            raise SyncError(None, failures)
        return connection

    async def _probe_all(self, adapters: Sequence[P2PReplicaAdapter], force: bool = False) -> list:
        """Read every rank's info (server args too for new or changed engines); exceptions are returned.
        `force`: re-read even with `recheck_rank_info` off (before a retry)."""

        async def probe(adapter: P2PReplicaAdapter) -> tuple[dict[int, RankAnswer], bool]:
            known = self._answers.get(adapter.engine)
            if known is None:
                await adapter.server_info(refresh=True)
                return await adapter.rank_answers(), True
            if not (self.recheck_rank_info or force):
                return known, False
            answers = await adapter.rank_answers(known)
            if not _changed(known, answers):
                return answers, False
            await adapter.server_info(refresh=True)  # rank info changed: the server may have restarted
            if len(answers) != adapter.num_ranks:
                answers = await adapter.rank_answers()
            return answers, True

        return await asyncio.gather(*(probe(a) for a in adapters), return_exceptions=True)

    def _assemble(self, adapters: Sequence[P2PReplicaAdapter], results: list, step: str = "connect"):
        """Probe results -> (connection, reconnected, failures); a new Connection only when something changed."""
        failures = [
            ReplicaFailure(step, a.engine, a.url, r)
            for a, r in zip(adapters, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failures:
            return self._connection, False, failures
        changed = set()
        for adapter, (answers, was_changed) in zip(adapters, results, strict=True):
            self._answers[adapter.engine] = answers
            if was_changed:
                changed.add(adapter.engine)
        engines = {a.engine for a in adapters}
        previous = self._connection
        if previous is not None and not changed and set(previous.server_infos) == engines:
            return previous, False, []
        server_infos, rank_infos, layouts, failures = {}, {}, {}, []
        for adapter in adapters:
            server_infos[adapter.engine] = info = adapter.cached_server_info
            for rank, answer in self._answers[adapter.engine].items():
                target = TargetRank(adapter.engine, rank)
                rank_infos[target] = answer.info
                if previous is not None and adapter.engine not in changed and target in previous.layouts:
                    layouts[target] = previous.layouts[target]
                    continue
                try:
                    layouts[target] = layout_from_server_args(info, rank)
                except Exception as exc:  # a layout the replica cannot reproduce: name the replica
                    failures.append(ReplicaFailure(step, adapter.engine, adapter.url, exc))
                    break
        if failures:
            for failure in failures:  # re-check those engines from scratch next time
                self._answers.pop(failure.engine, None)
            return previous, False, failures
        self._connection = Connection(
            generation=self._next_generation(),
            server_infos=server_infos,
            rank_infos=rank_infos,
            layouts=layouts,
            changed_engines=frozenset(changed),
            removed_engines=frozenset(set(previous.server_infos) - engines) if previous else frozenset(),
        )
        return self._connection, True, []

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
        run = _Run(self, version)
        adapters = self.adapters
        was_stale = {a.engine for a in adapters if a.engine in self._stale}
        try:
            await self._before_pause(run, adapters, prepare)
        except _Stop:  # nothing was paused: the rollout never noticed
            stale = [StaleReplica(a.engine, a.url, self._stale[a.engine]) for a in adapters if a.engine in self._stale]
            raise SyncError(version, run.failures, [], stale) from None
        run.paused_at = time.perf_counter()
        stage = "prepare"
        resumed: list[P2PReplicaAdapter] = []
        try:
            try:
                await self._prepare(run, adapters, prepare)
            except _Stop:
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

    async def _before_pause(self, run: _Run, adapters: list[P2PReplicaAdapter], prepare: Prepare | None) -> None:
        """Connect (rank info and server args: cached, re-read) and `prepare` (plan, assignments, the trainer's
        replicas, programs, slots, first-push check) while the rollout still generates; raises _Stop when
        either failed (nothing was paused)."""
        t0 = time.perf_counter()
        run.connection, run.reconnected, found = self._assemble(adapters, await self._probe_all(adapters))
        run.phases["connect"] = time.perf_counter() - t0
        run.stop_on(found)
        if prepare is not None:
            await self._run_prepare(run, prepare, "prepare")

    async def _run_prepare(self, run: _Run, prepare: Prepare, name: str) -> None:
        t0 = time.perf_counter()
        try:
            await prepare(run.connection)
        except Exception as exc:
            run.stop_on([ReplicaFailure(name, None, None, exc)])
        finally:
            run.phases[name] = time.perf_counter() - t0

    async def _recheck_in_pause(
        self, run: _Run, adapters: list[P2PReplicaAdapter], probing: asyncio.Future, prepare: Prepare | None
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

    async def _prepare(self, run: _Run, adapters: list[P2PReplicaAdapter], prepare: Prepare | None = None) -> None:
        """abort .. begin, then the rank-info recheck; raises _Stop when a step failed on any replica (nothing
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

    async def _restore_all(self, run: _Run, adapters: list[P2PReplicaAdapter]) -> None:
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
        self, run: _Run, adapter: P2PReplicaAdapter, resume_kv: bool, resume: bool
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

    # ---- the push ----------------------------------------------------------------------------------------------

    async def _push_with_retries(self, run: _Run, push: Push) -> set[TargetRank]:
        """Push; then re-push the targets it left unknown (`p2p_push_retries` times, their rank info re-read
        first). Returns the targets still unknown; their failures are in `run.failures` only then."""
        connection = run.connection
        failures: list[ReplicaFailure] = []
        unknown: set[TargetRank] = set()
        run.steps_in_pause.append("push")
        t0 = time.perf_counter()
        try:
            run.metrics = dict(await push(connection) or {})
        except Exception as exc:
            unknown = _unknown_after(exc, connection)
            failures.append(ReplicaFailure("push", None, None, exc))
            run.note_unknown(unknown, "push failed")
        finally:
            run.phases["push"] = time.perf_counter() - t0
        for attempt in range(1, self.config.p2p_push_retries + 1):
            if not unknown:
                break
            t0 = time.perf_counter()
            retry, found, restarted = await self._retry_connection(unknown)
            failures += found
            for failure in found:
                run.reasons[failure.engine] = (
                    run.reasons.get(failure.engine, "its bytes are unknown after the push")
                    + f"; its rank info could not be re-read for re-push {attempt}: {_first_line(failure.error)}"
                )
            restarted |= run.unprepared & set(retry.engines if retry is not None else ())
            if retry is not None and restarted:
                retry, found = await self._reprepare(run, retry, restarted, attempt)
                failures += found
            if retry is None:
                break
            logger.warning(
                "p2p: re-pushing %d target(s) the push left unknown (attempt %d of %d): %s",
                len(retry.targets),
                attempt,
                self.config.p2p_push_retries,
                ", ".join(map(str, retry.targets)),
            )
            run.retried += retry.targets
            run.steps_in_pause.append(f"push_retry_{attempt}")
            try:
                metrics = dict(await push(retry) or {})
                unknown -= set(retry.targets)
                if not run.metrics:
                    run.metrics = metrics
            except Exception as exc:
                again = _unknown_after(exc, retry)
                unknown = (unknown - set(retry.targets)) | again
                failures.append(ReplicaFailure(f"push retry {attempt}", None, None, exc))
                run.note_unknown(again, f"push and {attempt} re-push(es) failed")
            finally:
                run.phases[f"push_retry_{attempt}"] = time.perf_counter() - t0
        if unknown:
            run.failures += failures
        elif failures:
            logger.warning("p2p: the push failed, its re-push succeeded: %s", "; ".join(map(str, failures)))
        return unknown

    async def _retry_connection(
        self, unknown: set[TargetRank]
    ) -> tuple[Connection | None, list[ReplicaFailure], set[int]]:
        """A partial Connection over the unknown targets, their engines' rank info re-read (every target of an
        engine whose info changed: a restarted server), and the engines whose info changed."""
        engines = sorted({t.engine for t in unknown if t.engine in self._adapters})
        probed = [self._adapters[e] for e in engines]
        results = dict(zip(engines, await self._probe_all(probed, force=True), strict=True))
        failures = [
            ReplicaFailure("reconnect", e, self._adapters[e].url, r)
            for e, r in results.items()
            if isinstance(r, BaseException)
        ]
        ok = {e for e, r in results.items() if not isinstance(r, BaseException)}
        adapters = [a for a in self.adapters if a.engine in ok or a.engine in self._answers]
        every = [results[a.engine] if a.engine in ok else (self._answers[a.engine], False) for a in adapters]
        full, reconnected, found = self._assemble(adapters, every, step="reconnect")
        failures += found
        ok -= {f.engine for f in found}
        changed = full.changed_engines if reconnected else frozenset()
        targets = sorted(t for t in full.targets if t.engine in ok and (t in unknown or t.engine in changed))
        if not targets:
            return None, failures, set()
        partial = Connection(
            generation=self._next_generation(),
            server_infos={e: full.server_infos[e] for e in sorted({t.engine for t in targets})},
            rank_infos={t: full.rank_infos[t] for t in targets},
            layouts={t: full.layouts[t] for t in targets},
            changed_engines=frozenset(t.engine for t in targets),
            partial=True,
        )
        return partial, failures, {e for e in changed if e in partial.server_infos}

    async def _prepare_new_servers(
        self,
        run: _Run,
        adapters: list[P2PReplicaAdapter],
        when: str,
        previous: Connection | None,
        maybe_released: bool = False,
    ) -> tuple[list[P2PReplicaAdapter], list[ReplicaFailure]]:
        """A restarted server (new rank info) through the normal path's steps before it is written: abort,
        release KV, begin. Returns those that passed and the failures (their reasons noted). A server whose
        transfer-engine session ids changed from `previous` is a new process that never saw the checker's
        snapshot: it is not compared; other changes (an address, a size) keep the check. `maybe_released`: the
        restart may have come before this sync's abort and release reached the new server, so a refused release
        means it holds none already (logged); the begin after it still fails a server that does not answer."""
        for adapter in adapters:
            if self.checker is not None and _sessions_changed(previous, self._connection, adapter.engine):
                self.checker.forget(adapter.engine)
        live, failures = list(adapters), []

        async def release(adapter: P2PReplicaAdapter) -> None:
            try:
                await adapter.release_kv()
            except RolloutCallError as exc:
                if not maybe_released:
                    raise
                logger.warning("p2p: %s refused the KV release (%s): taken as released already", adapter, exc)

        steps = [("abort", lambda a: a.pause())]
        steps += [("release_kv", release)] if self.frees_kv else []
        steps += [("begin", self._begin)]
        for name, action in steps:
            found = await run.step(f"{name} ({when})", live, action)
            failures += found
            for failure in found:
                run.reasons[failure.engine] = (
                    f"its server restarted during the sync and {name} failed on it ({when}): "
                    f"{_first_line(failure.error)}"
                )
            live = [a for a in live if a.engine not in {f.engine for f in found}]
        return live, failures

    async def _reprepare(
        self, run: _Run, retry: Connection, restarted: set[int], attempt: int
    ) -> tuple[Connection | None, list[ReplicaFailure]]:
        """Engines whose rank info changed are new servers (a scheduler's transfer engine lives as long as its
        process): generating, KV allocated, no session. Before the re-push writes them they go through the
        normal path's steps (abort, release KV, begin); one where a step fails is left out of the re-push
        (unknown, named). The new server never saw the checker's snapshot: it is not compared."""
        adapters = [self._adapters[e] for e in sorted(restarted)]
        live, failures = await self._prepare_new_servers(
            run, adapters, f"restarted, before re-push {attempt}", run.connection
        )
        left_out = restarted - {a.engine for a in live}
        run.unprepared = set(left_out)  # a later re-push must prepare them first too
        targets = [t for t in retry.targets if t.engine not in left_out]
        if not targets:
            return None, failures
        return (
            dataclasses.replace(
                retry,
                server_infos={e: i for e, i in retry.server_infos.items() if e not in left_out},
                rank_infos={t: retry.rank_infos[t] for t in targets},
                layouts={t: retry.layouts[t] for t in targets},
                changed_engines=frozenset(e for e in retry.changed_engines if e not in left_out),
            ),
            failures,
        )

    # ---- after the push: each replica on its own ----------------------------------------------------------------

    async def _finish(self, run: _Run, adapters: list[P2PReplicaAdapter], unknown: set[TargetRank]) -> list:
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
                            run.mark_stale(adapter, f"check_compare failed: {_first_line(failure.error)}")
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

    async def _park(self, run: _Run, adapter: P2PReplicaAdapter) -> list[ReplicaFailure]:
        """A stale replica: end its session and resume its KV where possible; generation stays paused."""
        return await self._restore_one(run, adapter, adapter in run.released, resume=False)

    async def _timed_check(self, run: _Run, name: str, check, adapters) -> list[ReplicaFailure]:
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


class _Run:
    """One sync's bookkeeping: step timings, failures, which replicas were released/begun, the stale ones."""

    def __init__(self, lifecycle: SyncLifecycle, version: str) -> None:
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
            raise _Stop

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
            self.stale.setdefault(failure.engine, f"{failure.step} failed: {_first_line(failure.error)}")
        return [a for a in live if a.engine not in self.stale]


def _unknown_after(error: BaseException, connection: Connection) -> set[TargetRank]:
    """The targets a failed push left unknown: those its exception names, else every target it was given."""
    pushed = set(connection.targets)
    named = {t for t in unknown_targets_of(error) or () if t in pushed}
    return named or pushed


def _first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:limit]


def _sessions_changed(before: Connection | None, after: Connection | None, engine: int) -> bool:
    """Whether `engine`'s transfer-engine session ids differ between two connections (a new server process);
    unknown counts as changed."""
    if before is None or after is None:
        return True

    def sessions(connection: Connection) -> dict[int, str]:
        return {t.rank: i.session_id for t, i in connection.rank_infos.items() if t.engine == engine}

    return sessions(before) != sessions(after)


def _changed(known: Mapping[int, RankAnswer], answers: Mapping[int, RankAnswer]) -> bool:
    if set(known) != set(answers):
        return True
    return any(
        answers[r] is not known[r] and answers[r].info.fingerprint() != known[r].info.fingerprint() for r in answers
    )

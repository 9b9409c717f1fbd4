"""The sync sequence (docs/architecture.md, "One sync"): the only module that knows the order of the steps.

    abort -> release KV (when the rollout frees it) -> [checker: snapshot + reset, once] -> begin session
    -> connect (cached) -> push -> bump version -> end session -> [checker: compare, once]
    -> resume KV -> resume generation

Each step runs on every replica in parallel. A step that fails on any replica stops the forward steps: the
push never runs after a failed begin/connect, and a failed push never bumps a version. End session runs on
every replica a begin was sent to (a begin that failed may still have left a session open), resume KV on
every replica a release was sent to, and resume generation on every replica, whatever happened before.
Once a forward step has failed, each replica is restored on its own (end -> resume KV -> resume, replicas in
parallel), so a replica that hangs (a frozen rank: its end waits out http_timeout) holds back only itself and
the healthy ones go back to generating at once.

Connect is cached. Every sync re-reads each rank's transfer-engine info (one GET per rank, all in parallel,
overlapped with abort..begin: the info is fixed for a server's lifetime) and compares a digest of the raw
answer with the cached one; only a changed digest is parsed, and only a changed
`RemoteRankInfo.fingerprint()` (session id, an address or a size) counts as a change. Server args are fetched
once per engine and again only when its rank info changed (a restarted server) or the engine was re-added.
The decision is taken at the connect step, after begin. A change yields a new `Connection` (`generation` + 1,
`changed_engines`); otherwise the same object comes back, so the push side re-plans only on change.
`recheck_rank_info=False` skips the re-read (then only add/remove_adapters trigger a reconnect).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PError
from verl_p2p.planning.layout import RankLayout, layout_from_server_args
from verl_p2p.planning.targets import RemoteRankInfo, TargetRank
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.checker import WeightUpdateChecker
from verl_p2p.rollout.client import RankAnswer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Connection:
    """What the push needs about every target: rank info and layout per (engine, rank), server args per engine."""

    generation: int
    server_infos: Mapping[int, Mapping[str, Any]]
    rank_infos: Mapping[TargetRank, RemoteRankInfo]
    layouts: Mapping[TargetRank, RankLayout]
    changed_engines: frozenset[int] = frozenset()  # engines new or changed since the previous generation
    removed_engines: frozenset[int] = frozenset()

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


class SyncError(P2PError):
    """A sync failed; `failures` are the step that broke it, `cleanup` what failed while restoring."""

    def __init__(self, version: str | None, failures: Sequence[ReplicaFailure], cleanup: Sequence[ReplicaFailure] = ()):
        self.version, self.failures, self.cleanup = version, list(failures), list(cleanup)
        first = self.failures or self.cleanup
        what = f"weight sync to version {version!r}" if version is not None else "rollout"
        text = f"{what} failed at {first[0].step}: " + "; ".join(map(str, first))
        if self.failures and self.cleanup:
            text += " | while restoring: " + "; ".join(map(str, self.cleanup))
        super().__init__(text)


@dataclass
class SyncReport:
    """Per-step wall seconds (`total`, and `control_plane` = total minus push), the push's metrics."""

    version: str
    phases: dict[str, float]
    metrics: dict[str, Any]
    reconnected: bool
    generation: int
    engines_without_sessions: list[int] = field(default_factory=list)


Push = Callable[[Connection], Awaitable[Mapping[str, Any] | None]]


class _Stop(Exception):
    """Internal: a forward step failed; go straight to the restoring steps."""


class SyncLifecycle:
    """Runs syncs over a set of replica adapters; keeps the connect cache between syncs.

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
        self._running = False
        self.add_adapters(adapters)

    @property
    def adapters(self) -> list[P2PReplicaAdapter]:
        return [self._adapters[e] for e in sorted(self._adapters)]

    def add_adapters(self, adapters: Iterable[P2PReplicaAdapter]) -> None:
        """Add (or replace, by engine index) replicas; only their cached info is invalidated."""
        for adapter in adapters:
            self._adapters[adapter.engine] = adapter
            self._answers.pop(adapter.engine, None)
            adapter.forget()

    def remove_adapters(self, engines: Iterable[int | P2PReplicaAdapter]) -> None:
        for item in engines:
            engine = item.engine if isinstance(item, P2PReplicaAdapter) else int(item)
            self._adapters.pop(engine, None)
            self._answers.pop(engine, None)

    # ---- connect ---------------------------------------------------------------------------------------------

    async def connect(self) -> Connection:
        """The current Connection: the cached one when nothing changed (see the module docstring)."""
        adapters = self.adapters
        connection, _, failures = self._assemble(adapters, await self._probe_all(adapters))
        if failures:
            raise SyncError(None, failures)
        return connection

    async def _probe_all(self, adapters: Sequence[P2PReplicaAdapter]) -> list:
        """Read every rank's info (server args too for new or changed engines); exceptions are returned."""

        async def probe(adapter: P2PReplicaAdapter) -> tuple[dict[int, RankAnswer], bool]:
            known = self._answers.get(adapter.engine)
            if known is None:
                await adapter.server_info(refresh=True)
                return await adapter.rank_answers(), True
            if not self.recheck_rank_info:
                return known, False
            answers = await adapter.rank_answers(known)
            if not _changed(known, answers):
                return answers, False
            await adapter.server_info(refresh=True)  # rank info changed: the server may have restarted
            if len(answers) != adapter.num_ranks:
                answers = await adapter.rank_answers()
            return answers, True

        return await asyncio.gather(*(probe(a) for a in adapters), return_exceptions=True)

    def _assemble(self, adapters: Sequence[P2PReplicaAdapter], results: list):
        """Probe results -> (connection, reconnected, failures); a new Connection only when something changed."""
        failures = [
            ReplicaFailure("connect", a.engine, a.url, r)
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
                    failures.append(ReplicaFailure("connect", adapter.engine, adapter.url, exc))
                    break
        if failures:
            for failure in failures:  # re-check those engines from scratch next time
                self._answers.pop(failure.engine, None)
            return previous, False, failures
        self._connection = Connection(
            generation=(previous.generation + 1) if previous else 1,
            server_infos=server_infos,
            rank_infos=rank_infos,
            layouts=layouts,
            changed_engines=frozenset(changed),
            removed_engines=frozenset(set(previous.server_infos) - engines) if previous else frozenset(),
        )
        return self._connection, True, []

    # ---- sync ----------------------------------------------------------------------------------------------

    async def sync(self, version: Any, push: Push) -> SyncReport:
        """One weight sync to `version` (the global step); raises SyncError naming every failed replica."""
        if self._running:
            raise RuntimeError("SyncLifecycle.sync is already running: syncs must not overlap")
        self._running = True
        try:
            return await self._sync(str(version), push)
        finally:
            self._running = False

    async def _sync(self, version: str, push: Push) -> SyncReport:
        adapters = self.adapters
        phases: dict[str, float] = {}
        failures: list[ReplicaFailure] = []
        cleanup: list[ReplicaFailure] = []
        released: list[P2PReplicaAdapter] = []
        begun: list[P2PReplicaAdapter] = []
        begin_failed: set[int] = set()
        metrics: dict[str, Any] = {}
        connection, reconnected = self._connection, False
        with_sessions: list[P2PReplicaAdapter] = []
        ended = False
        start = time.perf_counter()

        async def step(name: str, targets: Sequence[P2PReplicaAdapter], action) -> list[ReplicaFailure]:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(action(a) for a in targets), return_exceptions=True)
            phases[name] = time.perf_counter() - t0
            return [
                ReplicaFailure(name, a.engine, a.url, r)
                for a, r in zip(targets, results, strict=True)
                if isinstance(r, BaseException)
            ]

        def stop_on(found: list[ReplicaFailure]) -> None:
            if found:
                failures.extend(found)
                raise _Stop

        # Rank info is fixed for a server's lifetime, so its per-sync re-read overlaps abort..begin; the
        # decision (reconnect or not) is taken at the connect step, after begin.
        probing = asyncio.ensure_future(self._probe_all(adapters))
        try:
            try:
                stop_on(await step("abort", adapters, lambda a: a.pause()))
                if self.frees_kv:
                    released = adapters
                    stop_on(await step("release_kv", adapters, lambda a: a.release_kv()))
                if self.checker is not None and self.checker.wants_arm:
                    stop_on(await self._timed_check("check_arm", self.checker.arm, adapters, phases))
                begun = adapters
                found = await step("begin", adapters, lambda a: a.begin_session())
                begin_failed = {f.engine for f in found}
                stop_on(found)
                t0 = time.perf_counter()
                connection, reconnected, found = self._assemble(adapters, await probing)
                phases["connect"] = time.perf_counter() - t0  # what the overlapped probe left on the path
                stop_on(found)
                t0 = time.perf_counter()
                try:
                    metrics = dict(await push(connection) or {})
                except Exception as exc:
                    stop_on([ReplicaFailure("push", None, None, exc)])
                finally:
                    phases["push"] = time.perf_counter() - t0
                stop_on(await step("bump_version", adapters, lambda a: a.bump_version(version)))
            except _Stop:
                pass
            finally:
                with_sessions = [a for a in begun if a.sessions_supported is not False]
                if with_sessions and not failures:
                    ended = True
                    for failure in await step("end", with_sessions, lambda a: a.end_session()):
                        if failure.engine in begin_failed:  # its begin failed: no session is the likely answer
                            logger.warning("after a failed begin (a session may not be open): %s", failure)
                        else:
                            failures.append(failure)
            if not failures and self.checker is not None and self.checker.wants_compare:
                failures += await self._timed_check("check_compare", self.checker.compare, adapters, phases)
        finally:
            if not probing.done():
                probing.cancel()
            if ended or not failures:
                if released:
                    cleanup += await step("resume_kv", released, lambda a: a.resume_kv())
                cleanup += await step("resume", adapters, lambda a: a.resume())
            else:  # the sync failed before end: restore each replica on its own (see the module docstring)
                t0 = time.perf_counter()
                chains = [self._restore_one(a, a in with_sessions, a in released, begin_failed) for a in adapters]
                cleanup += [f for found in await asyncio.gather(*chains) for f in found]
                phases["restore"] = time.perf_counter() - t0
            await asyncio.wait([probing])
        phases["total"] = time.perf_counter() - start
        phases["control_plane"] = phases["total"] - phases.get("push", 0.0)
        if failures or cleanup:
            raise SyncError(version, failures, cleanup)
        return SyncReport(
            version=version,
            phases=phases,
            metrics=metrics,
            reconnected=reconnected,
            generation=connection.generation if connection else 0,
            engines_without_sessions=[a.engine for a in adapters if a.sessions_supported is False],
        )

    @staticmethod
    async def _restore_one(
        adapter: P2PReplicaAdapter, end: bool, resume_kv: bool, begin_failed: set[int]
    ) -> list[ReplicaFailure]:
        """End (when a begin was sent), resume KV (when released), resume: one replica, each step tried."""
        found = []
        steps = [("end", adapter.end_session)] if end else []
        steps += [("resume_kv", adapter.resume_kv)] if resume_kv else []
        for name, action in [*steps, ("resume", adapter.resume)]:
            try:
                await action()
            except Exception as exc:
                failure = ReplicaFailure(name, adapter.engine, adapter.url, exc)
                if name == "end" and adapter.engine in begin_failed:  # no session is the likely answer
                    logger.warning("after a failed begin (a session may not be open): %s", failure)
                else:
                    found.append(failure)
        return found

    @staticmethod
    async def _timed_check(name: str, run, adapters, phases: dict[str, float]) -> list[ReplicaFailure]:
        t0 = time.perf_counter()
        try:
            await run(adapters)
            return []
        except Exception as exc:
            return [ReplicaFailure(name, None, None, exc)]  # the checker's message names each replica
        finally:
            phases[name] = time.perf_counter() - t0

    def close(self) -> None:
        for adapter in self._adapters.values():
            adapter.close()


def _changed(known: Mapping[int, RankAnswer], answers: Mapping[int, RankAnswer]) -> bool:
    if set(known) != set(answers):
        return True
    return any(
        answers[r] is not known[r] and answers[r].info.fingerprint() != known[r].info.fingerprint() for r in answers
    )

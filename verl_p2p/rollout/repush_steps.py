"""The push and its re-pushes within one sync: the targets a failed push left unknown are re-read, restarted
servers taken through abort, release KV and begin, and written again (`p2p_push_retries` times); a
`SyncLifecycle` step set, kept apart from the step order."""

from __future__ import annotations

import dataclasses
import logging
import time

from verl_p2p.errors import first_line
from verl_p2p.planning.targets import TargetRank
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.client import RolloutCallError
from verl_p2p.rollout.connect_steps import sessions_changed
from verl_p2p.rollout.sync_run import SyncRun, unknown_after
from verl_p2p.rollout.sync_types import Connection, Push, ReplicaFailure

logger = logging.getLogger("verl_p2p.rollout.lifecycle")  # one logger for the sync's steps, as before the split


class RepushSteps:
    """SyncLifecycle's push with re-pushes; uses the lifecycle's adapters, answers, connect cache, checker and
    session bookkeeping (`_begin`)."""

    async def _push_with_retries(self, run: SyncRun, push: Push) -> set[TargetRank]:
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
            unknown = unknown_after(exc, connection)
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
                    + f"; its rank info could not be re-read for re-push {attempt}: {first_line(failure.error)}"
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
                again = unknown_after(exc, retry)
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
        run: SyncRun,
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
            if self.checker is not None and sessions_changed(previous, self._connection, adapter.engine):
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
                    f"{first_line(failure.error)}"
                )
            live = [a for a in live if a.engine not in {f.engine for f in found}]
        return live, failures

    async def _reprepare(
        self, run: SyncRun, retry: Connection, restarted: set[int], attempt: int
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

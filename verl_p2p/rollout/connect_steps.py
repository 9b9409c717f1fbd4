"""Connect: every rank's transfer-engine info and every engine's server args, cached across syncs (the module
docstring of lifecycle.py has the rules); a `SyncLifecycle` step set, kept apart from the step order."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.planning.targets import TargetRank
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.client import RankAnswer
from verl_p2p.rollout.sync_types import Connection, ReplicaFailure, SyncError


class ConnectSteps:
    """SyncLifecycle's connect cache: reads rank info and server args and turns them into `Connection`s (a new one,
    with a new generation, only when something changed). Uses the lifecycle's `_answers`, `_connection`,
    `_generation` and `recheck_rank_info`."""

    def _next_generation(self) -> int:
        self._generation += 1
        return self._generation

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
            if not answers_changed(known, answers):
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


def sessions_changed(before: Connection | None, after: Connection | None, engine: int) -> bool:
    """Whether `engine`'s transfer-engine session ids differ between two connections (a new server process);
    unknown counts as changed."""
    if before is None or after is None:
        return True

    def sessions(connection: Connection) -> dict[int, str]:
        return {t.rank: i.session_id for t, i in connection.rank_infos.items() if t.engine == engine}

    return sessions(before) != sessions(after)


def answers_changed(known: Mapping[int, RankAnswer], answers: Mapping[int, RankAnswer]) -> bool:
    if set(known) != set(answers):
        return True
    return any(
        answers[r] is not known[r] and answers[r].info.fingerprint() != known[r].info.fingerprint() for r in answers
    )

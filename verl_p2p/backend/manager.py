"""P2PCheckpointEngineManager: the whole sync run from the driver (`rollout.checkpoint_manager_class`).

verl's stock manager (the engine-only path) reaches every rollout worker through Ray and rebuilds the
topology every sync. This manager talks to the SGLang servers directly over HTTP (lifecycle.py: abort,
begin, connect, push, version, end, flush, resume; a replica the push left unknown stays paused), and to the
trainer only for what must run there:

- first sync, and again only when the plan changes (a replica added/removed/restarted): one `prepare` round
  (trainer ranks' stages, once) and one `init_process_group` round carrying each rank's assignment, both
  before the abort (the lifecycle's prepare step): the trainer builds its replicas, compiles its programs,
  registers its slots and checks the programs against SGLang's loader while the rollout still generates;
- every sync: the push itself (`actor_wg.update_weights(mode="p2p")`), with verl's `set_global_steps` stamp
  on the replicas' server actors sent alongside it; a re-push of failed targets (`p2p_push_retries`) is one
  `init_process_group` round with the partial plan plus the push.

`add_replicas` / `remove_replicas` invalidate only those replicas' cached metadata: the next sync fetches
rank info for the new engines alone and re-plans; engines already connected are not asked again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import Any

from verl.checkpoint_engine.base import CheckpointEngineManager
from verl.utils.ray_utils import auto_await

from verl_p2p.backend import plugin
from verl_p2p.backend.failure_policy import SyncFailurePolicy
from verl_p2p.backend.metrics import PREFIX, sync_metrics
from verl_p2p.backend.outcomes import (
    Kind,
    RankOutcome,
    classify,
    not_waited_for,
    repush_exclusions,
    unreachable_ranks,
)
from verl_p2p.backend.topology import SourceMeta, assign
from verl_p2p.backend.waiting import describe, failed_ranks_text, wait_each
from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PConfigError, P2PError, PushError, first_line, in_flight_targets_of, unknown_targets_of

logger = logging.getLogger(__name__)


class P2PCheckpointEngineManager(CheckpointEngineManager):
    """CheckpointEngineManager for `checkpoint_engine.backend=verl_p2p` (or `p2p`); see the module docstring.

    Args:
        config: verl's CheckpointEngineConfig (backend must be `p2p`).
        actor_wg: the trainer's worker group (ranks built a P2PCheckpointEngine in init_model).
        replicas: verl SGLang rollout replicas with launched servers.
    """

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any]) -> None:
        plugin.raise_load_error("backend")
        super().__init__(config, actor_wg, replicas)
        plugin.check_backend(self.backend, [f"checkpoint_manager_class={plugin.MANAGER_CLASS}"])
        if not plugin.uses_verl_p2p(self.backend):
            raise P2PConfigError(
                f"P2PCheckpointEngineManager needs checkpoint_engine.backend={plugin.ALIAS}, got {self.backend!r}: "
                "set the backend, or drop actor_rollout_ref.rollout.checkpoint_manager_class"
            )
        self.p2p_config = P2PConfig.from_mapping((config.engine_kwargs or {}).get(self.backend))
        self._lifecycle: Any = None
        self._sync_failures = SyncFailurePolicy(self.p2p_config.p2p_max_consecutive_failures)
        self._checked: set[int] = set()
        self._sources: list[SourceMeta] | None = None
        self._plan_key: tuple | None = None
        self._assigned: list[tuple] = []  # per trainer rank (worker-group order): the targets it writes
        # this sync's trainer ranks (global rank) whose push did not succeed, classified (backend/outcomes.py): a
        # re-push plans around those that died, were late or failed naming no target
        self._outcomes: dict[int, RankOutcome] = {}
        # targets a write call of this sync may still land in -> the trainer rank holding the call (None: not known
        # which): kept out of every re-push of this sync
        self._busy: dict[Any, int | None] = {}
        self._generation = 0
        self.trainer_rounds = 0  # Ray rounds to the trainer other than the per-sync push (for tests and logs)

    # ---- replicas --------------------------------------------------------------------------------------------

    def add_replicas(self, replicas: list[Any]) -> None:
        super().add_replicas(replicas)
        if self._lifecycle is not None:
            self._lifecycle.add_adapters(self._adapters(replicas))

    def remove_replicas(self, replicas: list[Any]) -> None:
        super().remove_replicas(replicas)
        if self._lifecycle is not None:
            self._lifecycle.remove_adapters([r.replica_rank for r in replicas])
        self._checked -= {r.replica_rank for r in replicas}

    def _adapters(self, replicas: Sequence[Any]) -> list[Any]:
        from verl_p2p.rollout.adapter import adapters_from_replicas

        return adapters_from_replicas(replicas, self.p2p_config)

    # ---- sync ------------------------------------------------------------------------------------------------

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict:
        """One sync to version `global_steps`, under `p2p_max_consecutive_failures` (backend/failure_policy.py): a
        failed sync that left a replica paused is synced again at once; one that wrote nothing is retried by the
        next step's call (`checkpoint_engine/p2p/sync_failed` 1); the N-th failure in a row, or a lost trainer
        rank, raises SyncFailuresError (a SyncError naming the last failure and every replica left stale)."""

        async def attempt() -> dict:
            lifecycle = self._ensure_lifecycle(global_steps)
            await self._check_new_servers(lifecycle.adapters)
            report = await lifecycle.sync(
                global_steps, lambda connection: self._push(connection, global_steps), prepare=self._plan_before_pause
            )
            out = dict(report.metrics)
            out.update({f"{PREFIX}phase/{name}_s": seconds for name, seconds in report.phases.items()})
            out[f"{PREFIX}reconnected"] = float(report.reconnected)
            out[f"{PREFIX}retried_targets"] = float(len(report.retried_targets))
            return out

        return await self._sync_failures.run(attempt)

    def _ensure_lifecycle(self, global_steps: int | None) -> Any:
        if self._lifecycle is None:
            from verl_p2p.rollout.checker import WeightUpdateChecker
            from verl_p2p.rollout.lifecycle import SyncLifecycle

            checker = None
            if self.p2p_config.check_weight_update_equal:
                checker = WeightUpdateChecker(self.p2p_config, resumed_from_checkpoint=bool(global_steps))
            # SGLang can free the KV cache only through its memory saver, which p2p keeps off: nothing to release.
            self._lifecycle = SyncLifecycle(
                self._adapters(self.replicas), self.p2p_config, frees_kv=False, checker=checker
            )
        return self._lifecycle

    async def _check_new_servers(self, adapters: Sequence[Any]) -> None:
        from verl_p2p.rollout.launch import check_live_server_args

        async def check(adapter: Any) -> None:
            check_live_server_args(await adapter.server_info(), engine=adapter.engine, url=adapter.url)

        new = [a for a in adapters if a.engine not in self._checked]
        await asyncio.gather(*(check(a) for a in new))
        self._checked |= {a.engine for a in new}

    async def _plan_before_pause(self, connection: Any) -> None:
        """The lifecycle's prepare step, while the rollout still generates: (re)plan on change and send every
        trainer rank its assignment (it builds its replicas, programs and slots and checks them then)."""
        await self._ensure_plan(connection, in_pause=False)

    async def _ensure_plan(self, connection: Any, in_pause: bool) -> None:
        """Plan `connection` and hand out the assignments unless the trainer holds that plan already. A re-push
        (a partial connection) plans around the trainer ranks that died, were late or failed naming no target,
        and prefers other senders over a rank whose targets failed (`outcomes.repush_exclusions`): those get idle
        assignments (they still run the export, which is collective), and only the other ranks' answers are
        waited for."""
        sources = await self._source_metas()
        # engines whose begin answered 404 (no weight-update sessions): the trainer refuses models needing post-load
        # (before the first begin: what the server's release says, so that the begin's answer changes nothing)
        sessionless = self._lifecycle.sessionless_engines()
        excluded = repush_exclusions(sources, self._outcomes) if connection.partial else frozenset()
        unreachable = unreachable_ranks(self._outcomes) if connection.partial else frozenset()
        skip = not_waited_for(sources, self._outcomes) if connection.partial else frozenset()
        # a re-push is a plan of its own
        key = (connection.generation, tuple(connection.targets), tuple(sources), sessionless, excluded, unreachable)
        if key == self._plan_key:
            return
        if in_pause and not connection.partial:
            logger.warning(
                "p2p: planning inside the pause: %s",
                "an engine's begin answered that it has no weight-update sessions"
                if self._plan_key is not None and key[:3] == self._plan_key[:3]
                else "the targets changed after the plan made before the pause",
            )
        self._generation += 1
        assignments = assign(
            sources,
            connection.server_infos,
            connection.rank_infos,
            connection.layouts,
            self._generation,
            sessionless,
            exclude=excluded,
            unreachable=unreachable,
        )
        # every rank reports its own outcome to this driver: no outcome exchange between the ranks to wait on;
        # inside the pause (a re-push's plan, or one the pause changed) no connection is opened by a read first
        ordered = [
            dataclasses.replace(assignments[s.rank], driver_collects=True, warm_up=not in_pause) for s in sources
        ]
        needed = [i for i, s in enumerate(sources) if s.rank not in skip]
        calls = self.actor_wg.execute_checkpoint_engine(
            method=["init_process_group"] * len(sources), assignment=ordered
        )
        outcomes = await wait_each(calls, self.p2p_config.p2p_prepare_deadline_s, needed=needed)
        self.trainer_rounds += 1
        failed = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
        for i, error in failed:
            if i not in needed:
                logger.warning("p2p: excluded trainer rank %d did not take its idle assignment: %s", i, error)
        failed = [(i, o) for i, o in failed if i in needed]
        if failed:
            self._plan_key = None
            raise P2PError(
                f"p2p plan generation {self._generation}: init_process_group failed on " + failed_ranks_text(failed)
            ) from failed[0][1]
        self._plan_key = key
        self._assigned = [tuple(a.targets) for a in ordered]

    async def _push(self, connection: Any, global_steps: int | None) -> dict:
        """The lifecycle's push step. A re-push leaves out the targets a write call of this sync may still land in
        (a late rank's, or refused for a call still in flight): they stay unknown, named in its error."""
        if not connection.partial:
            self._outcomes, self._busy = {}, {}
        held = {t: self._busy[t] for t in connection.targets if t in self._busy} if connection.partial else {}
        if not held:
            return await self._push_planned(connection, global_steps)
        rest = _without(connection, held)
        error: BaseException | None = None
        if rest is not None:
            try:
                await self._push_planned(rest, global_steps)
            except Exception as exc:  # noqa: BLE001 - named with the held-back targets below
                error = exc
        raise self._held_back_error(held, rest, error) from error

    def _held_back_error(self, held: dict, rest: Any, error: BaseException | None) -> PushError:
        """One PushError naming each target kept out of the re-push (and why), plus the re-push's own failure."""
        lines = []
        for target, rank in sorted(held.items(), key=lambda item: str(item[0])):
            who = "a trainer rank" if rank is None else f"trainer rank {rank}"
            outcome = self._outcomes.get(rank) if rank is not None else None
            why = (
                f"it did not answer within p2p_push_deadline_s={self.p2p_config.p2p_push_deadline_s:g} s and its "
                "push may still be writing"
                if outcome is not None and outcome.kind is Kind.LATE
                else "an earlier push's write call to it is still blocked in the transport"
            )
            lines.append(
                f"{target}: not re-pushed: a write to it is still in flight from {who} ({why}) and could land "
                "over newer bytes; left paused until a later sync writes it"
            )
        unknown = set(held)
        if error is not None:
            pushed = set(rest.targets)
            unknown |= (set(unknown_targets_of(error) or ()) & pushed) or pushed
            lines.append(f"the re-push of the other targets failed: {describe(error)}")
        return PushError("p2p re-push: " + "; ".join(lines), unknown_targets=unknown)

    async def _push_planned(self, connection: Any, global_steps: int | None) -> dict:
        """Every trainer rank exports and writes (a re-push's partial plan, or one the pause changed, is handed out
        first); each reports its own outcome and metrics, combined here."""
        await self._ensure_plan(connection, in_pause=True)
        pushes = self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend)
        stamps = [s.set_global_steps.remote(global_steps) for r in self.replicas for s in getattr(r, "servers", [])]
        results, stamped = await asyncio.gather(
            self._push_outcomes(pushes, connection), wait_each(stamps, self.p2p_config.p2p_push_deadline_s)
        )
        for error in (o for o in stamped if isinstance(o, BaseException)):
            raise P2PError(f"p2p: verl's set_global_steps stamp failed: {first_line(error)}") from error
        per_rank = [r for r in results if isinstance(r, dict) and r]
        if not per_rank:
            return {}
        metrics = sync_metrics(per_rank, {"generation": float(self._generation)})
        # verl's fully_async trainer drops update_weights' metrics: the log keeps every sync's figures
        logger.info("p2p sync to version %s: %s", global_steps, json.dumps(metrics, sort_keys=True))
        return metrics

    async def _source_metas(self) -> list[SourceMeta]:
        if self._sources is None:
            world = self.actor_wg.world_size
            calls = self.actor_wg.execute_checkpoint_engine(["prepare"] * world)
            answers = await wait_each(calls, self.p2p_config.p2p_prepare_deadline_s)
            self.trainer_rounds += 1
            failed = [(i, a) for i, a in enumerate(answers) if isinstance(a, BaseException)]
            if failed:
                raise P2PError("p2p prepare failed on " + failed_ranks_text(failed)) from failed[0][1]
            wrong = [i for i, a in enumerate(answers) if not isinstance(a, dict) or a.get("p2p") != "trainer"]
            if wrong:
                raise P2PError(f"actor rank(s) {wrong} are not p2p trainer engines (backend mismatch?)")
            self._sources = [a["source"] for a in answers]
        return self._sources

    async def _push_outcomes(self, pushes: Any, connection: Any) -> list[Any]:
        """Every trainer rank's push result, each waited for at most `p2p_push_deadline_s`; when ranks failed, died
        or were late, one PushError naming each of them and the targets it left unknown: those its error names,
        else (a rank that died, was late, or failed before it knew) every target of its assignment, or of the push
        where the calls are not one per rank. Each rank's outcome is classified for the re-push
        (`outcomes.classify`: an aborted export group leaves every target of each of its ranks unknown); the
        targets a write call may still land in are noted busy."""
        calls = list(pushes or [])
        sources = self._sources or []
        per_rank = len(calls) == len(self._assigned) == len(sources)  # one call per rank, in worker-group order
        needed, skip = None, frozenset()
        if connection.partial and per_rank:  # not waited for: ranks planned around, and their export peers
            skip = not_waited_for(sources, self._outcomes)
            needed = [i for i, s in enumerate(sources) if s.rank not in skip]
        outcomes = await wait_each(calls, self.p2p_config.p2p_push_deadline_s, needed=needed)
        failed = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
        unknown: set | None = set()
        lines, lost = [], []
        for i, error in failed:
            if not per_rank:
                named = unknown_targets_of(error)
                for target in in_flight_targets_of(error):
                    self._busy.setdefault(target, None)
            elif connection.partial and not self._assigned[i] and (sources[i].rank in skip | self._outcomes.keys()):
                # a re-push planned around it: it had nothing to write
                logger.warning("p2p: trainer rank %d (excluded, idle in this re-push) failed: %s", i, first_line(error))
                continue
            else:
                outcome = self._note(classify(sources[i].rank, error, self._assigned[i]))
                named = outcome.unknown
                if outcome.gone:
                    lost.append(error)
            who = f"trainer rank {i}" if per_rank else "the trainer"
            left = ", ".join(str(t) for t in sorted(named, key=str)) if named is not None else "all (not known)"
            lines.append(f"{who}: {describe(error)} (targets left unknown: {left})")
            unknown = None if named is None or unknown is None else unknown | set(named)
        if not lines:
            return outcomes
        if unknown is None:  # said explicitly: the chain below may name fewer targets than were left unknown
            unknown = set(connection.targets)
        # chained to a rank that died or was late where one did, else to the first failure: the failure policy
        # reads the chain, and stops the run at once on a lost rank also when a live rank's failure came first
        cause = lost[0] if lost else failed[0][1]
        raise PushError("p2p push failed on " + "; ".join(lines), unknown_targets=unknown) from cause

    def _planned_around(self, rank: int) -> bool:
        outcome = self._outcomes.get(rank)
        return outcome is not None and outcome.planned_around

    def _note(self, outcome: RankOutcome) -> RankOutcome:
        """Keep a rank's outcome for this sync's re-pushes (one planned around stays so) and its busy targets."""
        if not self._planned_around(outcome.rank):
            self._outcomes[outcome.rank] = outcome
        for target in outcome.busy:
            self._busy.setdefault(target, outcome.rank)
        return outcome

    def close(self) -> None:
        if self._lifecycle is not None:
            self._lifecycle.close()


def _without(connection: Any, targets: Any) -> Any:
    """`connection` (a re-push's partial one) less `targets`; None when nothing is left."""
    keep = [t for t in connection.targets if t not in targets]
    if not keep:
        return None
    engines = {t.engine for t in keep}
    return dataclasses.replace(
        connection,
        server_infos={e: info for e, info in connection.server_infos.items() if e in engines},
        rank_infos={t: connection.rank_infos[t] for t in keep},
        layouts={t: connection.layouts[t] for t in keep},
        changed_engines=frozenset(connection.changed_engines) & engines,
    )

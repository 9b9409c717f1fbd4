"""P2PCheckpointEngine: verl's checkpoint-engine hooks mapped onto the p2p sync (docs/architecture.md, "One sync").

verl's stock CheckpointEngineManager drives every sync the same way: abort and release KV on every replica,
`prepare` on every worker, `build_topology` on the driver, `init_process_group` on every worker, then
`send_weights` (trainer) alongside `receive_weights` + the server adapter's update (rollout), `finalize`, resume
KV and generation. Here:

- `prepare`: trainer rank: report its rank, PP stage and the plan generation it holds. Rollout leader (rank 0
  of a replica): re-read its ranks' info (one GET each; a changed digest publishes it again), [check: snapshot +
  reset, first sync and re-arms], begin the session, publish rank info until acknowledged.
  Rollout follower: report its replica.
- `build_topology` (driver): plan every target onto one source per stage; send a trainer rank its assignment
  only when it changed, and each leader the acknowledgement of its rank info.
- `init_process_group`: trainer rank: take the assignment (connect on the first or a new one).
- `send_weights` (trainer): export the stage and write it (source) or only run the export's collectives
  (idle); rank 0 returns the combined metrics.
- `receive_weights` (rollout): note the version (global step); yields nothing.
- `finalize`: rollout leader: bump the version, end the session, [check: compare until passed], flush the prefix cache
  (verl resumes generation right after). A failed push raises from `send_weights`, so verl's manager never
  calls `finalize` nor resumes: every replica stays paused until a sync succeeds (docs/failures.md).

verl's own `set_global_steps` stamp still happens: the rollout's server adapter receives the empty stream and
stamps the version. Construction is cheap (verl builds the engine on every actor and rollout worker in every
trainer mode): it validates its options, finds its verl worker and decides trainer vs rollout; nothing
is imported, allocated or connected until a hook needs it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
from collections.abc import Coroutine, Generator, Mapping
from typing import Any

from verl.checkpoint_engine.base import CheckpointEngine

from verl_p2p.backend import metrics as p2p_metrics
from verl_p2p.backend.identity import register_engine
from verl_p2p.backend.roles import (
    Role,
    RolloutIdentity,
    Side,
    TrainerIdentity,
    find_owner_worker,
    rollout_identity,
    side_of,
    trainer_identity,
    weak,
)
from verl_p2p.backend.topology import DRIVER_CACHE, Assignment, EngineMeta, SourceMeta
from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PError, PushError, first_line, unknown_targets_of

logger = logging.getLogger(__name__)

# `prepare` metadata: {"p2p": <role>, ...}
TRAINER, LEADER, FOLLOWER = "trainer", "rollout_leader", "rollout_follower"


def run_sync(coro: Coroutine) -> Any:
    """Run a coroutine to completion from sync code, also inside a running event loop (Ray async actors).

    verl's `prepare` and `finalize` hooks are sync, and verl's CheckpointEngineWorker is a Ray async actor (it
    has `async def update_weights`), whose sync methods Ray runs on the actor's event loop thread
    (`ray._private.async_compat.sync_to_async`). Refusing a running loop would refuse every rollout worker, and
    the hook must return its answer, so the caller's thread waits: the coroutine runs on its own loop in a
    worker thread, never on the caller's loop (which it cannot reach while that loop waits on it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2p-sync") as pool:
        return pool.submit(asyncio.run, coro).result()


class P2PCheckpointEngine(CheckpointEngine):
    """Checkpoint engine `verl_p2p` (also `p2p`): trainer sources write straight into SGLang rollout ranks'
    weight memory. Registered by `identity.register_engine` below.

    Args:
        bucket_size: verl's `update_weights_bucket_megabytes` in bytes; unused (p2p sizes its transfer slots
            with the `bucket_size_mb` option).
        is_master: passed by verl on trainer ranks only (rank 0); its presence marks the trainer side.
        **options: `checkpoint_engine.engine_kwargs.<backend>` (verl passes the entry named like the backend:
            `verl_p2p`, or `p2p`), validated by P2PConfig.
    """

    def __init__(self, bucket_size: int, is_master: bool | None = None, **options: Any) -> None:
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.config = P2PConfig.from_mapping(options)
        owner = find_owner_worker()
        self._owner = weak(owner)
        self.side = side_of(is_master, owner)
        # trainer
        self._trainer: TrainerIdentity | None = None
        self._session: Any = None  # source.SourceSession, built on the first assignment
        self._assignment: Assignment | None = None
        self._outcome_ranks: tuple[int, ...] | None = None  # every trainer rank, for the outcome exchange
        self._exchanges = 0  # outcome exchanges so far: names a replacement group (senders.BoundedGroups)
        self._peers: tuple[tuple[int, ...] | None] | None = None  # (SourceMeta.export_peers,) once read
        # rollout
        self._rollout: RolloutIdentity | None = None
        self._full_stream: bool | None = None
        self._adapter: Any = None  # rollout.adapter.P2PReplicaAdapter, leader only
        self._checker: Any = None
        self._published: EngineMeta | None = None
        self._answers: Mapping[int, Any] | None = None  # rank -> RankAnswer behind `_published`
        self._acked: str | None = None
        self._in_sync = False  # between a leader's prepare and finalize
        self._session_open = False  # a begin was sent and no end has succeeded since (a failed end keeps it)
        self._finalized = True  # the last sync this leader prepared went through finalize
        self._version: int | None = None
        if self.side is Side.TRAINER and self.is_master:
            from verl_p2p.backend.guards import warn_hybrid_actor

            warn_hybrid_actor(owner)

    # ---- identity --------------------------------------------------------------------------------------------

    @property
    def owner(self) -> Any | None:
        """The verl worker that built this engine (ActorRolloutRefWorker or CheckpointEngineWorker), if found."""
        return self._owner() if self._owner is not None else None

    @property
    def role(self) -> Role:
        if self.side is Side.TRAINER:
            if self._assignment is None:
                return Role.TRAINER
            return Role.TRAINER_SOURCE if self._assignment.is_source else Role.TRAINER_IDLE
        return self.rollout.role

    def _streams_whole_model(self) -> bool:
        """Whether this trainer rank's engine is verl's FSDP engine (every rank streams the whole model), read once
        from the owner worker; the driver plans such ranks each onto a part of every target."""
        if self._full_stream is None:
            from verl_p2p.trainer.fsdp_export import is_fsdp_engine
            from verl_p2p.trainer.verl_engine import EngineAccessError, find_training_engine

            try:  # no engine found: a Megatron-style rank here; the source session names the problem at apply
                self._full_stream = self.owner is not None and is_fsdp_engine(find_training_engine(self.owner))
            except EngineAccessError:
                self._full_stream = False
        return self._full_stream

    def _export_peers(self) -> tuple[int, ...] | None:
        """The ranks this rank's export runs collectives with (`SourceMeta.export_peers`), read once."""
        if self._peers is None:
            from verl_p2p.trainer.verl_engine import EngineAccessError, export_peers, find_training_engine

            try:
                engine = find_training_engine(self.owner) if self.owner is not None else None
                self._peers = (None if engine is None else export_peers(engine, mode=self.config.export_mode),)
            except EngineAccessError:  # the source session names the problem at apply
                self._peers = (None,)
        return self._peers[0]

    @property
    def rollout(self) -> RolloutIdentity:
        if self._rollout is None:
            self._rollout = rollout_identity(self.owner)
        return self._rollout

    @property
    def trainer(self) -> TrainerIdentity:
        if self._trainer is None:
            self._trainer = trainer_identity()
        return self._trainer

    # ---- hooks -----------------------------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        if self.side is Side.TRAINER:
            me = self.trainer
            generation = self._assignment.generation if self._assignment else 0
            source = SourceMeta(
                me.rank,
                me.pp_stage,
                me.pp_size,
                generation,
                full_stream=self._streams_whole_model(),
                export_peers=self._export_peers(),
            )
            return {"p2p": TRAINER, "source": source}
        if self.rollout.role is Role.ROLLOUT_FOLLOWER:
            return {"p2p": FOLLOWER, "engine": self.rollout.replica_rank}
        return {"p2p": LEADER, "engine": run_sync(self._leader_prepare())}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return build_topology(actor_wg_world_size, rollout_world_size, metadata)

    def init_process_group(self, assignment: Assignment | int | None = None, ack: str | None = None, **_: Any):
        if self.side is Side.TRAINER:
            self.apply_assignment(assignment)
        elif ack is not None:
            self._acked = ack

    async def send_weights(self, weights: Generator | Any = None, global_steps: int | None = None) -> dict:
        """Export this rank's stage and write it to its targets; returns the sync's metrics on rank 0.

        `weights` is verl's `get_per_tensor_param()` generator, made by its worker for this sync. FSDP: it is the
        stream, consumed once (never a second export). Megatron: never iterated (a full export would broadcast
        every stage to every rank); the stage is exported PP-locally from the worker's Megatron engine instead.
        """
        if self.side is not Side.TRAINER:
            raise P2PError("send_weights called on a p2p rollout engine: only trainer ranks send")
        mine: dict[str, float] = {}
        error: BaseException | None = None
        try:
            if self._session is None:
                raise P2PError("p2p trainer rank has no plan: init_process_group was not called before send_weights")
            mine = p2p_metrics.as_dict(self._session.push(weights))
        except Exception as exc:  # every rank must reach the gather below, or the others wait forever
            error = exc
        rank = self.trainer.rank
        text = None if error is None else _outcome(error, rank)
        if self._assignment is not None and self._assignment.driver_collects:  # the manager combines the ranks
            if error is not None:
                raise PushError(
                    f"p2p push to version {global_steps} failed on trainer rank {rank}: {text}",
                    unknown_targets=self._unknown_after(error),
                ) from error
            return mine
        try:
            outcomes = self._gather((rank, mine, text, self._unknown_after(error)))
        except Exception as exc:  # a peer died or is late: this rank knows its own outcome only
            raise PushError(
                f"p2p push to version {global_steps}: trainer rank {rank} could not exchange push outcomes with the "
                f"other trainer ranks within p2p_push_deadline_s={self.config.p2p_push_deadline_s:g} s (a peer died "
                f"or hangs: {first_line(exc)}); its own push "
                + (f"failed: {text}" if error is not None else "completed, every target written"),
                unknown_targets=self._unknown_after(error),
            ) from (error or exc)
        failed = [(rank, why) for rank, _, why, _ in outcomes if why]
        if failed:
            text = "; ".join(f"trainer rank {rank}: {why}" for rank, why in failed)
            unknown = {t for *_, targets in outcomes for t in targets}
            raise PushError(f"p2p push to version {global_steps} failed: {text}", unknown_targets=unknown) from error
        if not self.is_master:
            return {}
        metrics = p2p_metrics.sync_metrics(
            [m for _, m, _, _ in outcomes], {"generation": float(self._assignment.generation)}
        )
        # verl's fully_async trainer drops update_weights' metrics: the log keeps every sync's figures
        logger.info("p2p sync to version %s: %s", global_steps, json.dumps(metrics, sort_keys=True))
        return metrics

    def _unknown_after(self, error: BaseException | None) -> list[Any]:
        """The targets this rank's failed push left unknown: those the error names, else all it writes."""
        if error is None:
            return []
        named = unknown_targets_of(error)
        if named:
            return sorted(named)
        return list(self._assignment.targets) if self._assignment is not None else []

    def receive_weights(self, global_steps: int | None = None):
        """Nothing travels through the rollout worker: note the version for `finalize` and yield nothing."""
        self._version = global_steps
        return iter(())

    def finalize(self) -> None:
        if self.side is Side.ROLLOUT and self._in_sync and self.rollout.role is Role.ROLLOUT_LEADER:
            run_sync(self._leader_finalize())

    # ---- trainer ---------------------------------------------------------------------------------------------

    def apply_assignment(self, assignment: Assignment | int | None) -> None:
        """Take this rank's part of the plan; an int means "unchanged" and must be the generation held."""
        if assignment is None:
            raise P2PError("p2p trainer rank got no assignment from build_topology")
        held = self._assignment.generation if self._assignment else 0
        if isinstance(assignment, int):
            if assignment != held:
                raise P2PError(f"p2p trainer rank holds plan generation {held}, the driver expects {assignment}")
            return
        if assignment.rank != self.trainer.rank:
            raise P2PError(f"assignment for trainer rank {assignment.rank} delivered to rank {self.trainer.rank}")
        if self._outcome_ranks is None:
            self._outcome_ranks = _trainer_ranks()
        if self._session is None:
            from verl_p2p.trainer.source import SourceSession

            self._session = SourceSession(self.config, self.owner, self.config.hostname, checkpoint_engine=self)
        self._session.apply(assignment)
        self._assignment = assignment
        logger.info(
            "p2p trainer rank %d: plan generation %d, %s",
            assignment.rank,
            assignment.generation,
            f"{len(assignment.targets)} target(s)" if assignment.is_source else "idle",
        )

    def _gather(self, item: Any) -> list[Any]:
        """Every trainer rank's `item`, over p2p's outcome group (timeout: the push deadline; a group broken by a
        dead or hung peer is dropped, and the next sync makes a new one)."""
        if self._outcome_ranks is None:
            return [item]
        from verl_p2p.trainer.senders import GROUPS

        self._exchanges += 1
        deadline = self.config.p2p_push_deadline_s
        return GROUPS.exchange("outcomes", self._outcome_ranks, item, deadline, self._exchanges)

    # ---- rollout leader --------------------------------------------------------------------------------------

    async def _leader_prepare(self) -> EngineMeta:
        adapter = self._leader_adapter()
        if self._in_sync:
            logger.warning("p2p: %s: the previous weight sync never finalized; ending its session", adapter)
        self._in_sync = False
        if self._session_open:  # a failed sync (no finalize, or a failed end) left it open: close it first
            try:
                await adapter.end_session()
            except Exception as exc:  # most likely it did end meanwhile ("no session is open")
                logger.warning("p2p: %s: closing the session an earlier sync left open: %s", adapter, exc)
            self._session_open = False
        if self._published is None or not self._finalized:  # after a failed sync: the server may have restarted
            await self._leader_publish(adapter)
        else:  # every sync: a scheduler restarted since the last good one publishes new sessions and addresses
            await self._leader_recheck(adapter)
        self._finalized = False
        if self._checker.wants_arm:
            await self._checker.arm([adapter])
        self._session_open = adapter.sessions_supported is not False  # a failed begin may still have opened one
        self._session_open = await adapter.begin_session()
        self._in_sync = True
        meta = dataclasses.replace(self._published, sessions=adapter.sessions_supported)  # known after begin
        if self._acked == meta.digest:
            return EngineMeta(meta.engine, meta.digest, sessions=meta.sessions)
        return meta

    def _leader_adapter(self) -> Any:
        if self._adapter is None:
            from verl_p2p.rollout.adapter import P2PReplicaAdapter
            from verl_p2p.rollout.checker import WeightUpdateChecker

            url = _server_url(self.rollout.replica_rank)
            # the server's API keys from verl's rollout config, as the server was started with them
            rollout_config = getattr(self.owner, "rollout_config", None)
            self._adapter = P2PReplicaAdapter.for_rollout(self.rollout.replica_rank, url, self.config, rollout_config)
            self._checker = WeightUpdateChecker(self.config)
        return self._adapter

    async def _leader_publish(self, adapter: Any) -> None:
        from verl_p2p.rollout.launch import check_live_server_args

        info = await adapter.server_info(refresh=True)
        check_live_server_args(info, engine=adapter.engine, url=adapter.url)
        bootstrap = _bootstrap_url(info, adapter.url)
        if bootstrap and adapter.client.bootstrap_url is None:
            from verl_p2p.rollout.client import normalize_url

            adapter.client.bootstrap_url = normalize_url(bootstrap)
        answers = await adapter.rank_answers()
        self._answers = answers
        self._published = EngineMeta(
            adapter.engine, _answers_digest(answers), dict(info), {rank: a.info for rank, a in answers.items()}
        )

    async def _leader_recheck(self, adapter: Any) -> None:
        """Re-read every rank's info (one GET per rank, in parallel) and compare the raw answers' digest with the
        published one, as the manager path does each sync; a change is a restarted server: publish it again
        (server args too), so the trainer never writes the old addresses."""
        answers = await adapter.rank_answers(self._answers)
        if _answers_digest(answers) != self._published.digest:
            logger.warning("p2p: %s: its rank info changed since the last sync (a restart?): publishing it", adapter)
            await self._leader_publish(adapter)

    async def _leader_finalize(self) -> None:
        adapter = self._adapter
        self._in_sync = False
        try:
            if self._version is not None:
                await adapter.bump_version(str(self._version))
        finally:
            if self._session_open:
                await adapter.end_session()
                self._session_open = False
        if self._checker.wants_compare:
            await self._checker.compare([adapter])
        await adapter.flush_cache()  # the writes bypassed SGLang's loader, which would have flushed it
        self._finalized = True


register_engine(P2PCheckpointEngine)


def _answers_digest(answers: Mapping[int, Any]) -> str:
    """One digest of every rank's raw rank-info answer (`RankAnswer.digest`): equal digests, nothing changed."""
    return hashlib.blake2b(repr(sorted((r, a.digest) for r, a in answers.items())).encode(), digest_size=16).hexdigest()


def _outcome(error: BaseException, rank: int) -> str:
    """What a rank reports of its failed push: its own cause, or (aborted by its export group's go/no-go for a
    peer's refusal) which peers refused; so the sync's error names each cause once."""
    from verl_p2p.trainer.senders import ExportAbortedError

    if isinstance(error, ExportAbortedError):
        if rank in error.failures:
            return error.failures[rank]
        refused = ", ".join(map(str, sorted(error.failures)))
        return f"did not export: its export group's go/no-go stopped it (trainer rank(s) {refused} refused)"
    return f"{type(error).__name__}: {error}"


# ---- driver ----------------------------------------------------------------------------------------------------


def build_topology(
    actor_world_size: int, rollout_world_size: int, metadata: list[Mapping[str, Any]]
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """verl's `build_topology` for p2p (driver): one assignment per trainer rank, one ack per rollout worker."""
    if len(metadata) != actor_world_size + rollout_world_size:
        raise P2PError(f"expected {actor_world_size} + {rollout_world_size} prepare() answers, got {len(metadata)}")
    actors, rollouts = metadata[:actor_world_size], metadata[actor_world_size:]
    wrong = [i for i, m in enumerate(actors) if m.get("p2p") != TRAINER]
    if wrong:
        raise P2PError(f"actor worker(s) {wrong} did not answer prepare() as p2p trainer ranks")
    sources = [m["source"] for m in actors]
    leaders = [m["engine"] for m in rollouts if m.get("p2p") == LEADER]
    followers = {m["engine"] for m in rollouts if m.get("p2p") == FOLLOWER}
    engines = sorted({e.engine for e in leaders})
    if len(engines) != len(leaders):
        raise P2PError(f"two rollout workers claim to lead the same replica: {[e.engine for e in leaders]}")
    leaderless = sorted(followers - set(engines))
    if leaderless:
        raise P2PError(f"rollout replica(s) {leaderless} have workers but no leader (rank 0) in this sync")
    for meta in leaders:
        DRIVER_CACHE.update_engine(meta)
    generation, assignments = DRIVER_CACHE.plan(sources, engines)
    # verl's stock manager calls this inside the pause: a trainer rank opens no connection by a read first (the
    # writes open them, each target on its own lane)
    fresh = {rank: dataclasses.replace(a, warm_up=False) for rank, a in assignments.items()}
    actor_kwargs = {"assignment": [generation if s.generation == generation else fresh[s.rank] for s in sources]}
    rollout_kwargs = {"ack": [m["engine"].digest if m.get("p2p") == LEADER else None for m in rollouts]}
    return actor_kwargs, rollout_kwargs


def _trainer_ranks() -> tuple[int, ...] | None:
    """Every trainer rank, for the per-sync outcome exchange (None when not distributed). It runs over one of p2p's
    own gloo groups (`senders.GROUPS`) whose timeout is the push deadline: a rank that finished waits there at most
    that long for a dead or hung peer, instead of torch's default 30 minutes."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return tuple(range(dist.get_world_size()))


def _server_url(replica_rank: int) -> str:
    """Node 0's HTTP address of verl's SGLang server actor for this replica (`sglang_server_{replica}_0`)."""
    import ray

    name = f"sglang_server_{replica_rank}_0"
    try:
        actor = ray.get_actor(name)
    except ValueError as exc:
        raise P2PError(f"p2p rollout leader: verl's SGLang server actor {name!r} not found ({exc})") from exc
    host, port = ray.get(actor.get_server_address.remote())
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{host}:{port}"


def _bootstrap_url(server_info: Mapping[str, Any], url: str) -> str | None:
    """Where the engine-info bootstrap server listens: `host` of the server args (the leader runs on node 0)."""
    port = server_info.get("engine_info_bootstrap_port")
    if not port:
        return None
    host = server_info.get("host") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        host = url.split("://")[-1].rsplit(":", 1)[0]
    return f"{host}:{port}"

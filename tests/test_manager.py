"""P2PCheckpointEngineManager over HTTP rollouts: the sync order, recovery, no trainer round-trips after the first
connect, and add/remove_replicas touching only the affected engines.

Stand-ins (named as such): the SGLang servers (tests/support/fake_sglang.py), verl's actor RayWorkerGroup (its
calls run in-process on real P2PCheckpointEngine objects instead of over Ray), verl's replicas (the attributes
the manager reads), and the trainer's data plane (SourceSession). The Ray end-to-end test with verl's real
workers and the loopback rollout covers those parts.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import verl  # noqa: F401
from support.fake_sglang import FakeSGLang
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.workers.config import CheckpointEngineConfig

from verl_p2p.backend.manager import P2PCheckpointEngineManager
from verl_p2p.backend.roles import TrainerIdentity
from verl_p2p.errors import P2PConfigError, P2PError, PushError
from verl_p2p.planning.targets import TargetRank
from verl_p2p.rollout.launch import BOOTSTRAP_PORT, MEMORY_SAVER, SEED_FLAG
from verl_p2p.rollout.lifecycle import SyncError

SYNC = [
    "pause_generation",
    "begin_weight_update",
    "push",
    "update_weight_version",
    "end_weight_update",
    "flush_cache",
    "continue_generation",
]
PARKED = ["pause_generation", "begin_weight_update", "end_weight_update"]  # stale: never continue_generation


class SourceSessionStandIn:
    """Stand-in for verl_p2p.trainer.source.SourceSession: records plans, 'pushes' by writing the stand-in servers
    of its targets (`FakeSGLang.write`, once per engine per push) and counting them."""

    fail_with: Exception | None = None
    servers: dict = {}  # engine -> FakeSGLang

    def __init__(self, config, owner, hostname=None, checkpoint_engine=None):
        self.applied = []

    def apply(self, assignment):
        self.applied.append(assignment)

    def push(self, weights=None):
        if self.fail_with is not None:
            raise self.fail_with
        targets = self.applied[-1].targets
        for engine in sorted({t.engine for t in targets}):
            self.servers[engine].write()
        return {"bytes": 100.0 * len(targets), "num_targets": float(len(targets)), "seconds/total": 0.1}


class ActorGroupStandIn:
    """Stand-in for verl's actor RayWorkerGroup: DP_COMPUTE / ONE_TO_ALL calls run on local engines."""

    def __init__(self, world_size: int):
        self.engines = []
        for rank in range(world_size):
            engine = CheckpointEngineRegistry.new("p2p", is_master=rank == 0, bucket_size=1 << 20)
            engine._trainer = TrainerIdentity(rank=rank, world_size=world_size, pp_stage=0, pp_size=1)
            self.engines.append(engine)
        self.world_size = world_size
        self.calls: list[str] = []

    def execute_checkpoint_engine(self, method, **kwargs):
        self.calls.append(method[0])
        return [
            getattr(engine, name)(**{k: v[i] for k, v in kwargs.items()})
            for i, (engine, name) in enumerate(zip(self.engines, method, strict=True))
        ]

    dead: dict = {}  # rank -> the exception its call raises instead (a dead actor), with one call per rank

    def update_weights(self, global_steps=None, mode="auto"):
        assert mode == "p2p"
        self.calls.append("update_weights")
        if not self.dead:
            return [self._push_all(global_steps)]
        return [  # as verl's worker group returns them: one call per rank
            self._raise(self.dead[i]) if i in self.dead else e.send_weights(None, global_steps=global_steps)
            for i, e in enumerate(self.engines)
        ]

    @staticmethod
    async def _raise(error):
        raise error

    async def _push_all(self, global_steps):
        """Every rank pushes; an error is raised as ray.get raises one. Real ranks gather each other's outcome over
        a process group and all raise with every rank's unknown targets: without one here, this forms the union."""
        outcomes = await asyncio.gather(
            *(e.send_weights(None, global_steps=global_steps) for e in self.engines), return_exceptions=True
        )
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            unknown = {t for e in errors for t in getattr(e, "unknown_targets", None) or ()}
            raise PushError(str(errors[0]), unknown_targets=unknown) from errors[0]
        return outcomes[0]


class ReplicaStandIn:
    """Stand-in for a launched verl SGLangReplica (what the manager and the adapter read; hashable like it)."""

    def __init__(self, index: int, fake: FakeSGLang):
        port = int(fake.bootstrap_url.rsplit(":", 1)[1])
        self.replica_rank = index
        self.server_address = fake.url.split("://")[1]
        self.config = SimpleNamespace(engine_kwargs={"sglang": {BOOTSTRAP_PORT: port, "host": "127.0.0.1"}})
        self.servers = []


@pytest.fixture
def fakes():
    servers = [FakeSGLang(tp_size=2, server_args={SEED_FLAG: True, MEMORY_SAVER: False}) for _ in range(3)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def setup(fakes, monkeypatch):
    monkeypatch.setattr("verl_p2p.trainer.source.SourceSession", SourceSessionStandIn)
    monkeypatch.setattr(SourceSessionStandIn, "fail_with", None)
    monkeypatch.setattr(SourceSessionStandIn, "servers", dict(enumerate(fakes)))
    actors = ActorGroupStandIn(world_size=2)
    # one sync per update_weights call: these tests look at a single failed sync (test_sync_failures: the retries)
    options = {"http_timeout": 10, "p2p_max_consecutive_failures": 1}
    config = CheckpointEngineConfig(backend="p2p", engine_kwargs={"p2p": options})
    replicas = [ReplicaStandIn(i, f) for i, f in enumerate(fakes[:2])]
    manager = P2PCheckpointEngineManager(config=config, actor_wg=actors, replicas=list(replicas))
    yield manager, actors, replicas
    manager.close()


def lifecycle(fake: FakeSGLang) -> list[str]:
    """The server's state-changing calls, the writes of several trainer ranks in a row counted as one push."""
    calls = fake.lifecycle_calls()
    return [c for i, c in enumerate(calls) if not (c == "push" and i and calls[i - 1] == "push")]


def targets_of(actors) -> list[TargetRank]:
    return sorted(t for e in actors.engines for t in e._session.applied[-1].targets)


def test_first_sync_connects_then_only_pushes(setup, fakes):
    manager, actors, _ = setup
    metrics = manager.update_weights(global_steps=1)
    for fake in fakes[:2]:
        assert lifecycle(fake) == SYNC
        assert fake.weight_version == "1"
    assert actors.calls == ["prepare", "init_process_group", "update_weights"]
    assert targets_of(actors) == [TargetRank(e, r) for e in (0, 1) for r in (0, 1)]
    # rank 0's metrics (without torch.distributed each rank combines only its own; see test_engine_roles)
    assert metrics["checkpoint_engine/p2p/bytes"] == 200.0
    assert metrics["checkpoint_engine/p2p/reconnected"] == 1.0
    assert "checkpoint_engine/p2p/phase/push_s" in metrics

    metrics = manager.update_weights(global_steps=2)
    assert actors.calls[3:] == ["update_weights"]  # no prepare/init_process_group round after the first connect
    assert manager.trainer_rounds == 2
    assert metrics["checkpoint_engine/p2p/reconnected"] == 0.0
    assert all(f.weight_version == "2" for f in fakes[:2])


def test_add_and_remove_replicas_reconnect_only_what_changed(setup, fakes):
    manager, actors, replicas = setup
    manager.update_weights(global_steps=1)
    manager.update_weights(global_steps=2)
    server_info_reads = [f.calls.count("server_info") for f in fakes]

    manager.add_replicas([ReplicaStandIn(2, fakes[2])])
    manager.update_weights(global_steps=3)
    assert [f.calls.count("server_info") for f in fakes][:2] == server_info_reads[:2]  # old engines not re-read
    assert fakes[2].calls.count("server_info") >= 1 and fakes[2].weight_version == "3"
    assert actors.calls[4:] == ["init_process_group", "update_weights"]  # re-planned, no prepare round
    assert {t.engine for t in targets_of(actors)} == {0, 1, 2}

    manager.remove_replicas([replicas[0]])
    calls_before = list(fakes[0].calls)
    manager.update_weights(global_steps=4)
    assert fakes[0].calls == calls_before and fakes[0].weight_version == "3"
    assert {t.engine for t in targets_of(actors)} == {1, 2}


def test_flushes_before_resuming_though_it_keeps_the_kv_cache(setup, fakes):
    """The driver path keeps the KV cache (no release, so nothing else empties the prefix cache): it flushes
    after the last write and the end, before resuming; no stale prefix is ever served."""
    manager, _, _ = setup
    for step in (1, 2):
        manager.update_weights(global_steps=step)
        for fake in fakes[:2]:
            calls = lifecycle(fake)[-len(SYNC) :]
            assert calls == SYNC and fake.violations == [] and not fake.paused


def test_failed_push_leaves_the_replicas_paused_until_a_sync_rewrites_them(setup, fakes):
    """A push error from every trainer rank (not one naming targets): every replica's bytes are unknown, so none
    is resumed and none is versioned; each is named stale. The failed targets are re-pushed once
    (p2p_push_retries=1: a re-plan round plus the push). The next sync rewrites and resumes them."""
    manager, actors, _ = setup
    manager.update_weights(global_steps=1)
    SourceSessionStandIn.fail_with = RuntimeError("write to 10.0.0.1:17000 timed out")
    calls = len(actors.calls)
    with pytest.raises(SyncError) as info:
        manager.update_weights(global_steps=2)
    error = info.value
    assert "timed out" in str(error) and isinstance(error, P2PError)
    assert [f.step for f in error.failures] == ["push", "push retry 1"] and error.stale_engines == [0, 1]
    assert actors.calls[calls:] == ["update_weights", "init_process_group", "update_weights"]
    for fake in fakes[:2]:
        assert lifecycle(fake)[len(SYNC) :] == PARKED
        assert fake.weight_version == "1" and fake.paused and not fake.session_open and fake.violations == []

    SourceSessionStandIn.fail_with = None
    manager.update_weights(global_steps=3)
    for fake in fakes[:2]:
        assert lifecycle(fake)[-len(SYNC) :] == SYNC
        assert fake.weight_version == "3" and not fake.paused and fake.violations == []
    assert targets_of(actors) == [TargetRank(e, r) for e in (0, 1) for r in (0, 1)]  # the full plan again


class ActorDiedStandIn(Exception):
    """Stand-in for Ray's RayActorError: what a call to a dead trainer rank raises (it names no target)."""


def test_a_dead_trainer_rank_is_named_and_its_targets_are_re_pushed_by_the_others(setup, fakes, caplog):
    """With one call per rank, every rank's outcome is waited for: the push error names the dead rank and the
    targets of its assignment, which alone are re-pushed, by the other rank (the re-plan gives the dead rank an
    idle assignment: before, it got part of them again and they stayed unknown)."""
    manager, actors, _ = setup
    manager.update_weights(global_steps=1)
    plan = {rank: set(engine._session.applied[-1].targets) for rank, engine in enumerate(actors.engines)}
    assert plan[1] and not plan[0] & plan[1]
    actors.dead = {1: ActorDiedStandIn("The actor died unexpectedly before finishing this task.")}
    with caplog.at_level("WARNING", logger="verl_p2p.rollout.lifecycle"):
        metrics = manager.update_weights(global_steps=2)
    text = caplog.text
    assert "trainer rank 1: ActorDiedStandIn: The actor died" in text
    assert all(str(t) in text for t in plan[1]), text
    assert metrics["checkpoint_engine/p2p/retried_targets"] == float(len(plan[1]))
    assert set(actors.engines[0]._session.applied[-1].targets) == plan[1]  # the re-push: rank 0 writes them
    assert actors.engines[1]._session.applied[-1].targets == ()  # the dead rank: idle
    for fake in fakes[:2]:
        assert fake.weight_version == "2" and not fake.paused and fake.violations == []
    actors.dead = {}


def test_refuses_a_rollout_that_does_not_publish(setup, fakes):
    manager, actors, _ = setup
    fakes[1].server_args[SEED_FLAG] = False
    with pytest.raises(P2PConfigError, match="rollout engine 1 .* does not publish"):
        manager.update_weights(global_steps=1)
    assert actors.calls == [] and fakes[1].lifecycle_calls() == []


def test_manager_needs_the_p2p_backend(setup):
    _, actors, replicas = setup
    with pytest.raises(P2PConfigError, match="needs checkpoint_engine.backend=verl_p2p, got 'naive'"):
        P2PCheckpointEngineManager(config=CheckpointEngineConfig(backend="naive"), actor_wg=actors, replicas=replicas)


def test_the_plan_round_runs_before_the_pause(setup, fakes):
    """The first sync's prepare and init_process_group rounds (the trainer builds, compiles, registers and checks
    then) come before the abort; a steady-state sync sends none; the pause holds no connect or plan call."""
    manager, actors, _ = setup
    journal: list[str] = []
    for fake in fakes:
        fake.journal = journal
    calls = actors.calls

    class Recorder(list):
        def append(self, item):
            journal.append(item)
            super().append(item)

    actors.calls = Recorder(calls)
    for step in (1, 2):
        journal.clear()
        metrics = manager.update_weights(global_steps=step)
        start = journal.index("pause_generation")
        end = len(journal) - 1 - journal[::-1].index("continue_generation")
        window = journal[start : end + 1]
        assert not {"prepare", "init_process_group", "server_info", "get_server_info"} & set(window), window
        assert "update_weights" in window
        before = journal[:start]
        assert ("init_process_group" in before) == (step == 1) and ("prepare" in before) == (step == 1)
        assert metrics["checkpoint_engine/p2p/phase/paused_s"] < metrics["checkpoint_engine/p2p/phase/total_s"]


def test_a_plan_handed_out_inside_the_pause_opens_no_connection_first(setup, fakes):
    """Review finding 2: a trainer rank opens its targets' connections by a read at apply, before the pause; the
    re-push's plan, handed out inside the pause, says not to (`warm_up=False`): the read would only delay it."""
    manager, actors, _ = setup
    manager.update_weights(global_steps=1)
    SourceSessionStandIn.fail_with = RuntimeError("write to 10.0.0.1:17000 timed out")
    with pytest.raises(SyncError):
        manager.update_weights(global_steps=2)  # the push and its re-push fail
    assert [a.warm_up for a in actors.engines[0]._session.applied] == [True, False]

"""P2PCheckpointEngine: cheap construction and role detection from verl's real construction, the driver's
topology, and the hooks of each role.

Stand-ins (named as such): the SGLang `ServerAdapter` (importing it needs SGLang's GPU kernels), the
trainer's data plane `SourceSession` (needs a Megatron model and Mooncake; the end-to-end test covers it),
and the SGLang server (tests/support/fake_sglang.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import verl  # noqa: F401  (registers p2p)
from support.fake_sglang import FakeSGLang
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.single_controller.base import Worker

from verl_p2p.backend import engine as engine_module
from verl_p2p.backend import topology
from verl_p2p.backend.engine import FOLLOWER, LEADER, TRAINER, P2PCheckpointEngine
from verl_p2p.backend.roles import Role, Side
from verl_p2p.backend.topology import Assignment, EngineMeta, SourceMeta
from verl_p2p.errors import P2PConfigError, P2PError, PushError, TransferError
from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo, TargetRank
from verl_p2p.rollout.launch import BOOTSTRAP_PORT, MEMORY_SAVER, SEED_FLAG

ROOT = Path(__file__).resolve().parents[1]

# ---- construction through verl's real classes, in a fresh interpreter where the heavy parts cannot load ------

CONSTRUCTION = r"""
import importlib.abc, json, os, socket, sys, threading

class Forbidden(importlib.abc.MetaPathFinder):  # constructing the engine must not need any of these
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("mooncake", "sglang", "megatron") or name.startswith(
            ("verl_p2p.trainer.source", "verl_p2p.transfer", "verl_p2p.replica", "verl_p2p.trainer.push",
             "verl_p2p.trainer.export", "verl_p2p.trainer.verl_engine", "verl_p2p.rollout.client",
             "verl_p2p.rollout.lifecycle")
        ):
            raise ImportError(f"forbidden during construction: {name}")

sys.meta_path.insert(0, Forbidden())
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0")

import verl
from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.workers.config import CheckpointEngineConfig, RolloutConfig
from verl_p2p.errors import P2PConfigError

kwargs = {"p2p": {"bucket_size_mb": 64, "protocol": "tcp"}}


class ServerAdapterStandIn:  # what verl's SGLang ServerAdapter sets in __init__ (replica_rank, rollout_rank)
    def __init__(self, replica_rank, rollout_rank):
        self.replica_rank, self.rollout_rank = replica_rank, rollout_rank


class ActorWorkerStandIn(Worker):
    # verl's ActorRolloutRefWorker.init_model builds the backend exactly like this (engine_workers.py)
    def init_model(self, config):
        backend = config.backend
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, is_master=(self.rank == 0), bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(backend, {}),
        )


def rollout_config(engine_kwargs):
    return RolloutConfig(name="sglang", tensor_model_parallel_size=2,
                         checkpoint_engine=CheckpointEngineConfig(backend="p2p", engine_kwargs=engine_kwargs))


modules, threads = set(sys.modules), threading.active_count()
actor = ActorWorkerStandIn()
actor.init_model(CheckpointEngineConfig(backend="p2p", engine_kwargs=kwargs))
leader = CheckpointEngineWorker(rollout_config=rollout_config(kwargs), model_config=None,
                                server_adapter=ServerAdapterStandIn(3, 0), replica_rank=3)
follower = CheckpointEngineWorker(rollout_config=rollout_config(kwargs), model_config=None,
                                  server_adapter=ServerAdapterStandIn(3, 1), replica_rank=3)
# verl's own env/kwargs when the adapter does not say (rank = RANK, replica from the worker's kwargs)
bare = CheckpointEngineWorker(rollout_config=rollout_config(kwargs), model_config=None,
                              server_adapter=object(), replica_rank=5)
new_modules = sorted(m for m in set(sys.modules) - modules if not m.startswith("torch"))
new_threads = threading.active_count() - threads

try:
    CheckpointEngineWorker(rollout_config=rollout_config({"p2p": {"bucket_mb": 64}}), model_config=None,
                           server_adapter=ServerAdapterStandIn(0, 0), replica_rank=0)
    bad = None
except P2PConfigError as exc:
    bad = str(exc)

def describe(worker):
    e = worker.checkpoint_engine
    return {"cls": type(e).__name__, "side": e.side.value, "owner": e.owner is worker, "role": e.role.value,
            "replica": e.rollout.replica_rank if e.side.value == "rollout" else None}

print(json.dumps({
    "actor": describe(actor), "leader": describe(leader), "follower": describe(follower), "bare": describe(bare),
    "is_master": actor.checkpoint_engine.is_master, "new_modules": new_modules, "new_threads": new_threads,
    "bad": bad,
}))
"""


@pytest.fixture(scope="module")
def constructed() -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CONSTRUCTION)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_construction_is_cheap(constructed):
    # no transport, replica, export, HTTP client or heavy package was imported (they were forbidden), no thread
    # started; the only modules construction may add are the small guards module (rank 0's hybrid warning) and the
    # server-args checks and the FSDP actor's config refusals (pure config reads) it uses
    light = {
        "verl_p2p.backend.guards",
        "verl_p2p.rollout",
        "verl_p2p.rollout.launch",
        "verl_p2p.rollout.post_processing",
        "verl_p2p.trainer",
        "verl_p2p.trainer.fsdp_config",
    }
    assert set(constructed["new_modules"]) <= light, constructed["new_modules"]
    assert constructed["new_threads"] == 0


def test_roles_from_verls_real_construction(constructed):
    assert constructed["actor"] == {
        "cls": "P2PCheckpointEngine",
        "side": "trainer",
        "owner": True,
        "role": "trainer",
        "replica": None,
    }
    assert constructed["is_master"] is True
    assert constructed["leader"] == {
        "cls": "P2PCheckpointEngine",
        "side": "rollout",
        "owner": True,
        "role": "rollout_leader",
        "replica": 3,
    }
    assert constructed["follower"]["role"] == "rollout_follower"
    assert constructed["follower"]["replica"] == 3
    assert constructed["bare"]["role"] == "rollout_leader"  # RANK=0 in its replica's worker group
    assert constructed["bare"]["replica"] == 5


def test_bad_engine_kwargs_fail_at_construction_naming_valid_keys(constructed):
    assert "unknown checkpoint_engine.engine_kwargs.verl_p2p" in constructed["bad"]
    assert "key(s) ['bucket_mb']" in constructed["bad"]
    assert "bucket_size_mb" in constructed["bad"]


# ---- driver: build_topology ------------------------------------------------------------------------------------


def rank_info(engine: int, rank: int, n_params: int = 2) -> RemoteRankInfo:
    params = {f"w{i}": RemoteParam(0x1000 * (engine + 1) + 0x100 * rank + i, 8, 2) for i in range(n_params)}
    return RemoteRankInfo(f"10.0.{engine}.{rank}:1700{rank}", params)


def engine_meta(engine: int, tp: int = 2, digest: str = "d0", publish: bool = True) -> EngineMeta:
    server_info = {"tp_size": tp, "ep_size": 1, "dp_size": 1, "model_path": "/m", "dtype": "bfloat16"}
    if not publish:
        return EngineMeta(engine, digest)
    return EngineMeta(engine, digest, server_info, {r: rank_info(engine, r) for r in range(tp)})


def prepared(sources: list[SourceMeta], leaders: list[EngineMeta], followers: list[int]) -> list[dict]:
    return (
        [{"p2p": TRAINER, "source": s} for s in sources]
        + [{"p2p": LEADER, "engine": m} for m in leaders]
        + [{"p2p": FOLLOWER, "engine": e} for e in followers]
    )


@pytest.fixture(autouse=True)
def fresh_driver_cache():
    topology.DRIVER_CACHE.reset()
    yield
    topology.DRIVER_CACHE.reset()


def test_build_topology_sends_plans_and_info_only_when_they_change():
    build = CheckpointEngineRegistry.get("p2p").build_topology
    sources = [SourceMeta(rank, pp_stage=rank // 2, pp_size=2) for rank in range(4)]
    meta = prepared(sources, [engine_meta(0), engine_meta(1)], [0, 1])
    actor_kwargs, rollout_kwargs = build(4, 4, meta)

    first = actor_kwargs["assignment"]
    assert all(isinstance(a, Assignment) for a in first)
    generation = first[0].generation
    # every (engine, rank) target gets exactly one sender in each of the two stages
    for stage in (0, 1):
        written = sorted(t for a in first if a.pp_stage == stage for t in a.targets)
        assert written == [TargetRank(e, r) for e in (0, 1) for r in (0, 1)]
    assert first[0].stage_ranks == (0, 1) and first[2].stage_ranks == (2, 3)
    assert rollout_kwargs == {"ack": ["d0", "d0", None, None]}
    assert all(a.rank_infos.keys() == set(a.targets) for a in first)
    assert not any(a.warm_up for a in first)  # built inside verl's pause: no warm-up read before the writes

    # next sync: every rank holds the plan, leaders send only their digest -> ints, no info resent
    held = [SourceMeta(s.rank, s.pp_stage, s.pp_size, generation) for s in sources]
    actor_kwargs, _ = build(
        4, 4, prepared(held, [engine_meta(0, publish=False), engine_meta(1, publish=False)], [0, 1])
    )
    assert actor_kwargs["assignment"] == [generation] * 4

    # a replica restarted (new digest, republished): a new generation for everyone
    actor_kwargs, _ = build(4, 4, prepared(held, [engine_meta(0, digest="d1"), engine_meta(1, publish=False)], [0, 1]))
    assert all(isinstance(a, Assignment) and a.generation == generation + 1 for a in actor_kwargs["assignment"])

    # a replica removed: a new plan over the remaining one only
    actor_kwargs, rollout_kwargs = build(4, 2, prepared(held, [engine_meta(0, digest="d1", publish=False)], [0]))
    new = actor_kwargs["assignment"]
    assert {t.engine for a in new for t in a.targets} == {0}
    assert rollout_kwargs == {"ack": ["d1", None]}


def test_build_topology_refuses_what_it_cannot_plan():
    build = P2PCheckpointEngine.build_topology
    sources = [SourceMeta(0, 0)]
    with pytest.raises(P2PError, match="no leader"):
        build(1, 2, prepared(sources, [], [0, 0]))
    with pytest.raises(P2PError, match="has no copy of digest"):
        build(1, 1, prepared(sources, [engine_meta(0, publish=False)], []))
    with pytest.raises(P2PError, match="not answer prepare"):
        build(1, 1, [{"p2p": LEADER, "engine": engine_meta(0)}, {"p2p": LEADER, "engine": engine_meta(0)}])
    with pytest.raises(P2PError, match="published ranks"):
        meta = engine_meta(0, tp=2)
        build(1, 1, prepared(sources, [EngineMeta(0, "x", meta.server_info, {0: meta.rank_infos[0]})], []))


# ---- trainer rank --------------------------------------------------------------------------------------------


class SourceSessionStandIn:
    """Stand-in for verl_p2p.trainer.source.SourceSession (the data plane needs Megatron + Mooncake)."""

    fail_with: Exception | None = None

    def __init__(self, config, owner, hostname=None, checkpoint_engine=None):
        self.applied: list[Assignment] = []

    def apply(self, assignment):
        self.applied.append(assignment)

    def push(self, weights=None):
        if self.fail_with is not None:
            raise self.fail_with
        if not self.applied[-1].targets:
            return None
        # the shape of push.PushMetrics.to_dict(prefix="")
        return {"bytes": 1000.0, "num_targets": 1.0, "gbps": 9.9, "seconds/total": 0.5, "seconds/load": 0.2}


@pytest.fixture
def trainer(monkeypatch):
    monkeypatch.setattr("verl_p2p.trainer.source.SourceSession", SourceSessionStandIn)
    monkeypatch.setattr(SourceSessionStandIn, "fail_with", None)
    return CheckpointEngineRegistry.new("p2p", is_master=True, bucket_size=1 << 20, p2p_transfer_timeout=5)


def assignment(generation: int, targets=(), rank: int = 0) -> Assignment:
    infos = {t: rank_info(t.engine, t.rank) for t in targets}
    return Assignment(generation, rank, 0, 1, (rank,), (rank,) if targets else (), tuple(targets), infos)


def test_trainer_becomes_source_or_idle_from_its_assignment(trainer):
    assert trainer.side is Side.TRAINER and trainer.role is Role.TRAINER
    meta = trainer.prepare()
    assert meta["p2p"] == TRAINER and meta["source"] == SourceMeta(0, 0, 1, 0)

    trainer.init_process_group(assignment=assignment(1, [TargetRank(0, 0)]))
    assert trainer.role is Role.TRAINER_SOURCE
    assert trainer.prepare()["source"].generation == 1
    trainer.init_process_group(assignment=1)  # unchanged plan: nothing re-applied
    assert len(trainer._session.applied) == 1
    with pytest.raises(P2PError, match="holds plan generation 1, the driver expects 2"):
        trainer.init_process_group(assignment=2)
    with pytest.raises(P2PError, match="delivered to rank 0"):
        trainer.init_process_group(assignment=assignment(2, rank=3))

    metrics = asyncio.run(trainer.send_weights(iter(()), global_steps=7))
    assert metrics["checkpoint_engine/p2p/bytes"] == 1000.0
    assert metrics["checkpoint_engine/p2p/seconds/load"] == 0.2
    assert metrics["checkpoint_engine/p2p/gbps"] == pytest.approx(1000 / 0.5 / 1e9)  # recomputed over ranks
    assert metrics["checkpoint_engine/p2p/sources"] == 1.0
    assert metrics["checkpoint_engine/p2p/generation"] == 1.0
    assert all(k.startswith("checkpoint_engine/p2p/") for k in metrics)

    trainer.init_process_group(assignment=assignment(2))
    assert trainer.role is Role.TRAINER_IDLE


def test_trainer_push_failure_names_the_rank_and_the_targets_left_unknown(trainer):
    """The error carries the targets whose bytes are unknown, for the driver to keep exactly those replicas
    paused: those a writer failure names, else every target of the rank (it cannot tell which it wrote)."""
    targets = [TargetRank(0, 0), TargetRank(1, 0), TargetRank(1, 1)]
    trainer.init_process_group(assignment=assignment(1, targets))
    SourceSessionStandIn.fail_with = RuntimeError("peer 10.0.0.0:17000 gone")
    with pytest.raises(PushError, match=r"push to version 3 failed: trainer rank 0: RuntimeError: peer 10.0.0.0") as e:
        asyncio.run(trainer.send_weights(None, global_steps=3))
    assert e.value.unknown_targets == frozenset(targets)
    SourceSessionStandIn.fail_with = TransferError("write to engine 1 rank 1 timed out", [TargetRank(1, 1)])
    with pytest.raises(PushError, match="trainer rank 0: TransferError: write to engine 1 rank 1") as e:
        asyncio.run(trainer.send_weights(None, global_steps=4))
    assert e.value.unknown_targets == {TargetRank(1, 1)}
    assert pickle.loads(pickle.dumps(e.value)).unknown_targets == {TargetRank(1, 1)}  # as Ray carries it


def test_send_weights_before_a_plan_is_refused(trainer):
    with pytest.raises(P2PError, match="init_process_group was not called"):
        asyncio.run(trainer.send_weights(None, global_steps=1))


# ---- rollout leader / follower against a stand-in SGLang server ------------------------------------------------


class RolloutWorkerStandIn(Worker):
    """Stand-in for verl's CheckpointEngineWorker: builds the backend the same way (no is_master)."""

    def __init__(self, server_adapter, engine_kwargs):  # Worker.__init__ skipped: it needs a Ray worker's env
        self.rollout_config = SimpleNamespace(name="sglang")
        self.server_adapter = server_adapter
        self.checkpoint_engine = CheckpointEngineRegistry.new("p2p", bucket_size=1 << 20, **engine_kwargs)


GOOD_ARGS = {SEED_FLAG: True, MEMORY_SAVER: False, "host": "127.0.0.1"}


@pytest.fixture
def server(monkeypatch):
    with FakeSGLang(tp_size=2, server_args=GOOD_ARGS) as fake:
        monkeypatch.setattr(engine_module, "_server_url", lambda replica: fake.url)
        fake.server_args[BOOTSTRAP_PORT] = int(fake.bootstrap_url.rsplit(":", 1)[1])
        fake.paused = True  # verl's stock manager aborts generation before prepare
        yield fake


def leader(**kwargs) -> RolloutWorkerStandIn:
    return RolloutWorkerStandIn(SimpleNamespace(replica_rank=2, rollout_rank=0), kwargs)


def test_rollout_leader_runs_its_part_of_the_sync(server):
    worker = leader()
    engine = worker.checkpoint_engine
    assert engine.side is Side.ROLLOUT and engine.role is Role.ROLLOUT_LEADER

    meta = engine.prepare()
    assert meta["p2p"] == LEADER
    published = meta["engine"]
    assert published.engine == 2 and sorted(published.rank_infos) == [0, 1]
    assert published.server_info["tp_size"] == 2
    assert server.session_open
    assert server.bootstrap_calls.count("get_transfer_engine_info") == 2  # straight from the bootstrap server

    engine.init_process_group(ack=published.digest)
    server.write()  # stands for the trainer's push landing on this engine
    assert list(engine.receive_weights(global_steps=11)) == []
    engine.finalize()
    assert server.weight_version == "11" and not server.session_open
    assert not server.cache_stale  # flushed in finalize: verl resumes generation right after it

    again = engine.prepare()["engine"]  # acknowledged and unchanged: only the digest travels
    assert again == EngineMeta(2, published.digest, sessions=True)  # sessions: known once begin was sent
    assert server.bootstrap_calls.count("get_transfer_engine_info") == 4  # re-read: one GET per rank
    engine.receive_weights(global_steps=12)
    engine.finalize()
    sync = ["begin_weight_update", "push", "update_weight_version", "end_weight_update", "flush_cache"]
    assert server.lifecycle_calls() == sync + [c for c in sync if c != "push"]


def test_rollout_leader_sends_the_api_key_its_rollout_config_names(monkeypatch):
    """A server started with SGLang's api_key (verl's rollout.engine_kwargs.sglang.api_key) answers 401 without it:
    the engine path's leader builds its adapter from verl's rollout config and sends the key on every call."""
    with FakeSGLang(tp_size=2, server_args=GOOD_ARGS, api_key="s3cret") as fake:
        monkeypatch.setattr(engine_module, "_server_url", lambda replica: fake.url)
        fake.server_args[BOOTSTRAP_PORT] = int(fake.bootstrap_url.rsplit(":", 1)[1])
        fake.paused = True
        worker = leader()
        worker.rollout_config = SimpleNamespace(name="sglang", engine_kwargs={"sglang": {"api_key": "s3cret"}})
        engine = worker.checkpoint_engine
        published = engine.prepare()["engine"]
        engine.init_process_group(ack=published.digest)
        fake.write()
        list(engine.receive_weights(global_steps=3))
        engine.finalize()
        assert fake.weight_version == "3" and not fake.session_open


def test_rollout_leader_closes_a_session_left_open_by_a_failed_sync(server, caplog):
    worker = leader()
    engine = worker.checkpoint_engine
    engine.prepare()  # then the push failed: verl's manager never called finalize
    with caplog.at_level(logging.WARNING, logger="verl_p2p.backend.engine"):
        engine.prepare()
    assert "never finalized" in caplog.text
    assert server.lifecycle_calls()[-3:] == ["begin_weight_update", "end_weight_update", "begin_weight_update"]
    assert server.weight_version == "default"  # a failed sync never bumps the version


def test_rollout_leader_closes_a_session_whose_end_failed(server):
    """Review defect 5: finalize's end failed, so the session stayed open; the next prepare must end it before
    its begin (which the server refuses while a session is open), not only after a sync that never finalized."""
    worker = leader()
    engine = worker.checkpoint_engine
    engine.init_process_group(ack=engine.prepare()["engine"].digest)
    server.write()
    engine.receive_weights(global_steps=3)
    server.fail("end_weight_update", 500, {"error": {"message": "injected"}}, times=1)
    with pytest.raises(P2PError, match="injected"):
        engine.finalize()
    assert server.session_open  # the failed end left it open
    engine.prepare()  # before the fix: begin refused, "a weight-update session is already open"
    assert server.session_open
    server.write()
    engine.receive_weights(global_steps=4)
    engine.finalize()
    assert server.weight_version == "4" and not server.session_open
    calls = server.lifecycle_calls()
    assert calls[calls.index("end_weight_update") :][:3] == [
        "end_weight_update",
        "end_weight_update",
        "begin_weight_update",
    ]


def test_rollout_leader_rereads_rank_info_after_a_failed_sync(server):
    """A sync failed (verl never called finalize) because the server restarted at the same address: the next
    prepare publishes the new rank info (new sessions), not the acknowledged digest of the dead server's."""
    worker = leader()
    engine = worker.checkpoint_engine
    first = engine.prepare()["engine"]
    engine.init_process_group(ack=first.digest)
    server.restart({0: "127.0.0.1:19000", 1: "127.0.0.1:19001"})
    server.paused = True  # verl's manager aborts before prepare
    again = engine.prepare()["engine"]  # before: the old digest only (acknowledged), the trainer kept old sessions
    assert again.digest != first.digest and again.rank_infos[0].session_id == "127.0.0.1:19000"
    assert server.session_open
    engine.init_process_group(ack=again.digest)
    server.write()
    engine.receive_weights(global_steps=2)
    engine.finalize()
    assert server.weight_version == "2" and not server.session_open
    calls = server.bootstrap_calls.count("get_transfer_engine_info")
    assert engine.prepare()["engine"] == EngineMeta(2, again.digest, sessions=True)  # unchanged: digest only
    assert server.bootstrap_calls.count("get_transfer_engine_info") == calls + 2  # one GET per rank, no more


def test_rollout_leader_rereads_rank_info_after_a_good_sync(server):
    """Review finding 9: the scheduler restarts between two syncs that both went through finalize. The next
    prepare re-reads every rank's info (one GET per rank), sees the digest change and publishes the new sessions
    with the server args; before the fix it sent the acknowledged digest and the trainer wrote the old addresses."""
    worker = leader()
    engine = worker.checkpoint_engine
    first = engine.prepare()["engine"]
    engine.init_process_group(ack=first.digest)
    server.write()
    engine.receive_weights(global_steps=1)
    engine.finalize()
    server.restart({0: "127.0.0.1:19010", 1: "127.0.0.1:19011"})
    server.paused = True  # verl's manager aborts before prepare
    infos = server.calls.count("server_info") + server.calls.count("get_server_info")
    again = engine.prepare()["engine"]
    assert again.digest != first.digest and again.server_info is not None
    assert [again.rank_infos[r].session_id for r in (0, 1)] == ["127.0.0.1:19010", "127.0.0.1:19011"]
    assert server.calls.count("server_info") + server.calls.count("get_server_info") == infos + 1  # args re-read
    engine.init_process_group(ack=again.digest)
    server.write()
    engine.receive_weights(global_steps=2)
    engine.finalize()
    assert server.weight_version == "2" and not server.session_open


def test_rollout_leader_refuses_a_server_that_does_not_publish(server):
    server.server_args.update({SEED_FLAG: False, MEMORY_SAVER: True})
    with pytest.raises(P2PConfigError, match="memory saver"):
        worker = leader()
        worker.checkpoint_engine.prepare()
    assert "begin_weight_update" not in server.lifecycle_calls()


def test_rollout_follower_does_nothing(server):
    worker = RolloutWorkerStandIn(SimpleNamespace(replica_rank=2, rollout_rank=1), {})
    engine = worker.checkpoint_engine
    assert engine.role is Role.ROLLOUT_FOLLOWER
    assert engine.prepare() == {"p2p": FOLLOWER, "engine": 2}
    engine.init_process_group(ack=None)
    assert list(engine.receive_weights(global_steps=1)) == []
    engine.finalize()
    assert server.calls == []


def test_metrics_of_all_ranks_combine_into_one_key_set():
    from verl_p2p.backend.metrics import sync_metrics

    ranks = [
        {"bytes": 3e9, "seconds/total": 1.0, "seconds/load": 0.4, "gbps": 3.0, "peak_staged_bytes": 10.0},
        {"bytes": 1e9, "seconds/total": 2.0, "seconds/load": 0.1, "gbps": 0.5, "peak_staged_bytes": 30.0},
        {},  # an idle rank
    ]
    out = sync_metrics(ranks, {"generation": 4.0})
    assert out == {
        "checkpoint_engine/p2p/bytes": 4e9,
        "checkpoint_engine/p2p/gbps": 2.0,  # all bytes over the slowest rank's push
        "checkpoint_engine/p2p/generation": 4.0,
        "checkpoint_engine/p2p/peak_staged_bytes": 30.0,
        "checkpoint_engine/p2p/seconds/load": 0.4,
        "checkpoint_engine/p2p/seconds/total": 2.0,
        "checkpoint_engine/p2p/sources": 2.0,
    }


@pytest.mark.parametrize("pushed", [True, False])
def test_rollout_leader_checks_the_first_sync_when_asked(server, pushed):
    from verl_p2p.rollout.checker import WeightCheckError

    worker = leader(check_weight_update_equal=True)
    engine = worker.checkpoint_engine
    engine.prepare()  # snapshot + reset_tensors before the session opens
    assert server.lifecycle_calls() == ["weights_checker", "weights_checker", "begin_weight_update"]
    assert [b["action"] for b in server.bodies["weights_checker"]] == ["snapshot", "reset_tensors"]
    if pushed:
        server.write()  # stands for the trainer's push landing on this engine
    engine.receive_weights(global_steps=0)
    if pushed:
        engine.finalize()
        assert server.checker == "compared"
    else:
        with pytest.raises(WeightCheckError, match="compare failed on engine 2"):
            engine.finalize()
    assert not server.session_open and server.weight_version == "0"  # the version is bumped before comparing


def test_run_sync_inside_a_running_loop_runs_the_coroutine_on_its_own_loop_and_thread():
    """As Ray runs a sync hook of an async actor: on the loop's thread, inside a coroutine (sync_to_async)."""
    import threading

    from ray._private.async_compat import sync_to_async

    where = {}

    async def work(fail: bool) -> str:
        where["loop"], where["thread"] = asyncio.get_running_loop(), threading.get_ident()
        if fail:
            raise ValueError("from the coroutine")
        return "answer"

    def hook(fail: bool = False) -> str:
        return engine_module.run_sync(work(fail))

    async def actor_loop():
        caller = asyncio.get_running_loop(), threading.get_ident()
        answer = await sync_to_async(hook)()
        assert (where["loop"], where["thread"]) != caller and where["loop"] is not caller[0]
        with pytest.raises(ValueError, match="from the coroutine"):
            await sync_to_async(hook)(True)
        return answer

    assert asyncio.run(actor_loop()) == "answer"
    assert hook() == "answer"  # no loop running: asyncio.run on this thread

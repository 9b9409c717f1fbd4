"""A trainer rank that dies (SIGKILL) or hangs in its export, with 4 trainer ranks (review findings 5, 26, 27).

Manager path: 4 trainer ranks as Ray actors (real P2PCheckpointEngine each), 2 stand-in SGLang servers of 2 ranks
(tests/support/fake_sglang.py), the real manager and sync lifecycle. Rank 2 dies or hangs in its second push's
export: the sync fails within `p2p_push_deadline_s` (not the 30 minutes a gloo group waits by default), names
rank 2, leaves only its target unknown (its engine stays paused, stale), and the restore steps run on the other
engine (its session ended, resumed). With a re-push allowed, the survivors rewrite the dead rank's target and
every engine resumes (the stand-in ranks export alone, as TP1 data-parallel copies: the re-push needs no
collective with the dead rank; with real collectives see tests/test_stalled_rank_go_no_go.py).

Engine-only path: 4 ranks over gloo (torch.multiprocessing); the outcome exchange after the push waits at most
the push deadline, and a survivor reports its own completed push (no target of its own unknown).

Stand-ins: see tests/support/deadline_ranks.py and tests/support/fake_sglang.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import ray
from support import deadline_ranks
from support.fake_sglang import FakeSGLang, free_port
from test_manager import ReplicaStandIn
from verl.workers.config import CheckpointEngineConfig

from verl_p2p.backend.manager import P2PCheckpointEngineManager
from verl_p2p.planning.targets import TargetRank
from verl_p2p.rollout.launch import MEMORY_SAVER, SEED_FLAG
from verl_p2p.rollout.lifecycle import SyncError

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
DEADLINE_S = 6.0
MARGIN_S = 8.0  # the driver's round trips and a busy 2-core host
VICTIM = 2  # its target: engine 1 rank 0 (4 ranks onto 4 targets in order)
OPTIONS = {
    "p2p_push_deadline_s": DEADLINE_S,
    "p2p_prepare_deadline_s": DEADLINE_S,
    "p2p_transfer_timeout": 2.0,
    "http_timeout": 10,
}


@pytest.fixture(scope="module")
def cluster():
    saved = os.environ.get("PYTHONPATH")
    # Ray's workers inherit this process's environment: the repo and tests/ (the stand-ins' module) importable
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), saved or ""])
    ray.init(
        address="local",
        num_cpus=WORLD,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
    )
    yield
    ray.shutdown()
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="module")
def healthy_ranks(cluster):
    """The ranks other than the victim, started once for the module: each test gives them a new engine (`reset`)."""
    actors = {
        r: deadline_ranks.start_rank(deadline_ranks.TrainerRankActor, r, WORLD, OPTIONS, None)
        for r in range(WORLD)
        if r != VICTIM
    }
    ray.get([actor.ready.remote() for actor in actors.values()], timeout=300)
    yield actors
    for actor in actors.values():
        ray.kill(actor)


@pytest.fixture
def world(healthy_ranks, request):
    """The victim in a new process each test (it dies or hangs), the healthy ranks reset, the servers new."""
    fault, retries = request.param
    options = {**OPTIONS, "p2p_push_retries": retries}
    victim = deadline_ranks.start_rank(deadline_ranks.TrainerRankActor, VICTIM, WORLD, options, fault)
    resets = [actor.reset.remote(options) for actor in healthy_ranks.values()]
    ray.get([victim.ready.remote(), *resets], timeout=300)
    actors = [victim if r == VICTIM else healthy_ranks[r] for r in range(WORLD)]
    servers = [FakeSGLang(tp_size=2, server_args={SEED_FLAG: True, MEMORY_SAVER: False}) for _ in range(2)]
    config = CheckpointEngineConfig(backend="p2p", engine_kwargs={"p2p": options})
    group = deadline_ranks.RayActorGroupStandIn(actors)
    manager = P2PCheckpointEngineManager(config, group, [ReplicaStandIn(i, s) for i, s in enumerate(servers)])
    yield manager, servers
    manager.close()
    ray.kill(victim)
    for server in servers:
        server.stop()


@pytest.mark.parametrize("world", [(("kill", 2), 0), (("hang", 2), 0)], indirect=True, ids=["killed", "hung"])
def test_a_rank_dying_or_hanging_in_its_export_fails_fast_and_leaves_only_its_target_unknown(world):
    manager, servers = world
    manager.update_weights(global_steps=1)
    assert all(s.weight_version == "1" and not s.paused for s in servers)

    t0 = time.monotonic()
    with pytest.raises(SyncError) as info:
        manager.update_weights(global_steps=2)
    seconds = time.monotonic() - t0
    text = str(info.value)
    assert seconds < DEADLINE_S + MARGIN_S, f"the sync took {seconds:.1f} s for a deadline of {DEADLINE_S} s"
    assert f"trainer rank {VICTIM}:" in text and str(TargetRank(1, 0)) in text, text
    for rank in set(range(WORLD)) - {VICTIM}:
        assert f"trainer rank {rank}:" not in text, text  # the survivors completed: not named
    assert info.value.stale_engines == [1]  # only the victim's target is unknown
    assert not servers[0].paused and servers[0].weight_version == "2"  # written whole: versioned, resumed
    assert servers[1].paused and servers[1].weight_version == "1"  # unknown: parked
    for server in servers:  # the restore steps ran: no session left open, no protocol violation
        assert not server.session_open and server.violations == []
        assert "end_weight_update" in server.lifecycle_calls()[-3:]


@pytest.mark.parametrize("world", [(("kill", 2), 1)], indirect=True, ids=["killed"])
def test_the_survivors_re_push_the_dead_ranks_target(world):
    manager, servers = world
    manager.update_weights(global_steps=1)
    t0 = time.monotonic()
    metrics = manager.update_weights(global_steps=2)  # the re-push plans around rank 2: the sync succeeds
    seconds = time.monotonic() - t0
    assert seconds < DEADLINE_S + MARGIN_S, f"the sync took {seconds:.1f} s: the re-push waited for rank 2?"
    assert metrics["checkpoint_engine/p2p/retried_targets"] == 1.0
    assert all(s.weight_version == "2" and not s.paused and s.violations == [] for s in servers)


@pytest.mark.parametrize("world", [(("hang", 2), 1)], indirect=True, ids=["hung"])
def test_no_survivor_re_pushes_the_hung_ranks_target(world):
    """A hung rank's call may still be writing its target (R30): the re-push gives it to no survivor; it stays
    paused and named, within one deadline (nothing is waited for a second time)."""
    manager, servers = world
    manager.update_weights(global_steps=1)
    t0 = time.monotonic()
    with pytest.raises(SyncError) as info:
        manager.update_weights(global_steps=2)
    seconds = time.monotonic() - t0
    text = str(info.value)
    assert seconds < DEADLINE_S + MARGIN_S, f"the sync took {seconds:.1f} s for a deadline of {DEADLINE_S} s"
    assert f"{TargetRank(1, 0)}: not re-pushed: a write to it is still in flight from trainer rank {VICTIM}" in text
    assert info.value.stale_engines == [1] and servers[1].paused and servers[1].weight_version == "1"
    assert not servers[0].paused and servers[0].weight_version == "2"


@pytest.mark.parametrize("world", [(("plan", 1), 0)], indirect=True, ids=["plan_hangs"])
def test_a_rank_hanging_in_the_plan_round_fails_the_sync_before_the_pause(world):
    manager, servers = world
    t0 = time.monotonic()
    with pytest.raises(SyncError) as info:
        manager.update_weights(global_steps=1)
    seconds = time.monotonic() - t0
    assert seconds < DEADLINE_S + MARGIN_S, f"the sync took {seconds:.1f} s for a deadline of {DEADLINE_S} s"
    assert f"trainer rank {VICTIM}: LateError: trainer rank {VICTIM} did not answer within" in str(info.value)
    for server in servers:  # failed in the prepare step, before the abort: nothing paused, nothing written
        assert not server.paused and "pause_generation" not in server.lifecycle_calls()


@pytest.mark.parametrize("kind", ["kill"])
def test_engine_path_survivors_stop_waiting_at_the_push_deadline(kind):
    """verl's stock manager path: the ranks exchange their outcomes over a gloo group whose timeout is the push
    deadline (before: torch's 1800 s default, and the rank opposite a killed one stayed blocked)."""
    from verl_p2p.backend.topology import SourceMeta, assign
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo
    from verl_p2p.sandbox import forked

    args = {"tp_size": 2, "dtype": "float32"}
    targets = [TargetRank(e, r) for e in (0, 1) for r in (0, 1)]
    infos = {t: RemoteRankInfo(f"127.0.0.1:{1000 + i}", {"w": RemoteParam(4096, 4, 4)}) for i, t in enumerate(targets)}
    layouts = {t: layout_from_server_args(args, t.rank) for t in targets}
    sources = [SourceMeta(r, 0) for r in range(WORLD)]
    assignments = assign(sources, {0: args, 1: args}, infos, layouts, generation=1)
    options = {"p2p_push_deadline_s": DEADLINE_S, "p2p_transfer_timeout": 2.0}
    out = forked.context().Queue()
    port = free_port()
    procs = [
        forked.process(
            deadline_ranks.gloo_rank,
            (r, WORLD, port, options, assignments[r], (kind, 1) if r == VICTIM else None, out),
        )
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        reports = {}
        end = time.monotonic() + 120  # the spawned ranks import torch and verl first
        while len(reports) < WORLD - 1 and time.monotonic() < end:
            try:
                rank, seconds, kind_, message, unknown = out.get(timeout=max(0.1, end - time.monotonic()))
            except Exception:  # noqa: BLE001 - queue.Empty: reported below
                break
            reports[rank] = (seconds, kind_, message, unknown)
        survivors = sorted(set(range(WORLD)) - {VICTIM})
        assert sorted(reports) == survivors, f"survivors still blocked: {sorted(set(survivors) - set(reports))}"
        for rank, (seconds, kind_, message, unknown) in reports.items():
            assert seconds < DEADLINE_S + MARGIN_S, f"rank {rank} waited {seconds:.1f} s"
            assert kind_ == "PushError" and "could not exchange push outcomes" in message, message
            assert "its own push completed" in message and unknown == set(), (rank, message, unknown)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def test_a_late_calls_outcome_is_taken_and_logged_when_it_comes(cluster, caplog):
    """A call past its deadline is a LateError for the sync; its outcome, when it comes, is taken and logged on
    one line (left untaken, Ray prints it as an "Unhandled error" traceback that reads like a second failure)."""
    import asyncio
    import logging

    from verl_p2p.backend.waiting import wait_each
    from verl_p2p.errors import LateError

    @ray.remote(num_cpus=0)
    class SlowRank:
        def fail_after(self, seconds: float) -> None:
            time.sleep(seconds)
            raise ValueError("export failed after the deadline")

    rank = SlowRank.remote()
    ray.get(rank.__ray_ready__.remote(), timeout=120)
    with caplog.at_level(logging.INFO, logger="verl_p2p.backend.waiting"):
        (outcome,) = asyncio.run(wait_each([rank.fail_after.remote(2.0)], 0.2))
        assert isinstance(outcome, LateError) and "trainer rank 0 did not answer within 0.2 s" in str(outcome)
        end = time.monotonic() + 60
        while "after its deadline" not in caplog.text and time.monotonic() < end:
            time.sleep(0.1)
    expected = "trainer rank 0 failed after its deadline: ValueError: export failed after the deadline"
    assert expected in caplog.text and "Unhandled error" not in caplog.text, caplog.text
    ray.kill(rank)

"""R29 through the driver: the real P2PCheckpointEngineManager drives four Ray actors, each ONE rank of a real gloo
world (Megatron-Bridge TP2 x DP2: ranks {0, 1} and {2, 3} each export together), each holding a real
P2PCheckpointEngine whose push is the real SourceSession (go/no-go over p2p's bounded groups, the PP-local export,
Mooncake tcp writes) into receiver processes holding the rollout ranks' memory (tests/support/manager_export_ranks.py,
tests/test_stalled_rank_export.py's `Targets`). Rank 2 signals itself after 3 streamed tensors of a push.

- kill (`p2p_push_retries=1`): its TP peer fails at once, Ray reports rank 2 dead; the manager's re-push plans
  around both and writes their targets through the data-parallel copy {0, 1}: `update_weights` returns within
  the push deadline plus MARGIN_S, every target's bytes what SGLang's loader holds from the checkpoint.
- stop: ranks 2 and 3 (waiting in its TP gather) are late; the sync fails after one push deadline, naming rank 2,
  their targets kept out of the re-push (their calls may still write, R30) and left paused, the others resumed;
  a late rank stops the run at once (SyncFailuresError, docs/failures.md "What the training job sees"). After
  SIGCONT the pair finishes its late call and the next full sync is exact on every target.

Stand-ins, named as such: the rollout's control plane (tests/support/fake_sglang.py, one TP1 engine per receiver,
claiming the installed SGLang release, without weight-update sessions as that release; its rank info is the
receiver's session and weight addresses), verl's replicas (test_manager's ReplicaStandIn), verl's worker group
and actor worker (tests/support/deadline_ranks.py, tests/support/manager_export_ranks.py).

One world for the module: "stop" runs first (its victim comes back); "kill" leaves rank 2 dead, so it runs last.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
from support.deadline_ranks import RayActorGroupStandIn, start_rank
from support.fake_sglang import FakeSGLang, free_port
from support.manager_export_ranks import ExportRankWorker
from support.stalled_export import Trainer, p2p_options
from test_manager import ReplicaStandIn
from test_push_deadline import cluster  # noqa: F401 - the module's local Ray cluster (log_to_driver=False)
from test_stalled_rank_export import Targets
from verl.workers.config import CheckpointEngineConfig

from verl_p2p.backend.failure_policy import SyncFailuresError
from verl_p2p.backend.manager import P2PCheckpointEngineManager
from verl_p2p.backend.metrics import PREFIX
from verl_p2p.rollout.launch import MEMORY_SAVER, SEED_FLAG
from verl_p2p.rollout.lifecycle import SyncError

pytestmark = pytest.mark.slow
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

WORLD = 4
VICTIM, PEER, SURVIVORS = 2, 3, (0, 1)  # the victim's TP peer; the data-parallel copy
# p2p_push_deadline_s: a new gloo group of 4 ranks meets within it on a loaded 2-core host (4 s did not, at load 28)
DEADLINE_S = 8.0
GROUP_TIMEOUT_S = 30.0  # the trainer's own groups: longer than the "stop" lasts (one deadline and the driver's steps)
MARGIN_S = 8.0  # the driver's round trips (a re-push's plan round, a new go/no-go group) on a busy 2-core host
AFTER = 3  # tensors the victim streams before its signal
RETRIED = f"{PREFIX}retried_targets"


@dataclass
class World:
    manager: Any
    actors: list[Any]
    pids: list[int]
    servers: list[FakeSGLang]
    rollout: Targets
    step: int = 0

    def sync(self) -> tuple[dict | SyncError, float]:
        """One `update_weights` after a 0xFF fill of every target: (its metrics or its SyncError, seconds)."""
        self.rollout.fill()
        self.step += 1
        t0 = time.monotonic()
        try:
            out = self.manager.update_weights(global_steps=self.step)
        except SyncError as exc:
            out = exc
        return out, time.monotonic() - t0

    def exact_sync(self) -> float:
        """A sync with nothing failing: every target written whole, every byte SGLang's load, all resumed."""
        metrics, seconds = self.sync()
        assert isinstance(metrics, dict), metrics
        assert metrics[RETRIED] == 0.0 and metrics[f"{PREFIX}failed_attempts"] == 0.0, metrics
        assert self.rollout.wrong(f"sync{self.step}") == {}
        assert all(s.weight_version == str(self.step) and not s.paused for s in self.servers)
        return seconds

    def held(self, ranks: Any) -> dict[int, dict]:
        return dict(zip(ranks, ray.get([self.actors[r].held.remote() for r in ranks], timeout=60), strict=True))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from verl_p2p.sandbox.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def world(cluster, model_dir, tmp_path_factory):  # noqa: F811 - the imported fixture
    from verl_p2p.replica.rank_context import installed_sglang_version

    trainer = Trainer("megatron", WORLD, free_port(), str(model_dir), DEADLINE_S, GROUP_TIMEOUT_S)
    options = {**p2p_options(trainer), "p2p_push_retries": 1, "p2p_prepare_deadline_s": 120.0, "http_timeout": 10}
    actors = [start_rank(ExportRankWorker, r, trainer, options) for r in range(WORLD)]
    servers: list[FakeSGLang] = []
    rollout = manager = None
    pids: list[int] = []
    try:
        rollout = Targets(model_dir, WORLD, tmp_path_factory.mktemp("dumps"))  # while the ranks build
        pids = ray.get([a.ready.remote() for a in actors], timeout=300)
        args = {SEED_FLAG: True, MEMORY_SAVER: False, "dtype": "float32"}
        for target in rollout.targets:  # engine e: receiver e's memory, published as SGLang's rank 0 would
            fake = FakeSGLang(tp_size=1, version=installed_sglang_version(), sessions=False, server_args=args)
            receiver = rollout.receivers[target]
            fake.rank_info = {0: [receiver.session_id, dict(receiver.weights_info)]}
            servers.append(fake)
        config = CheckpointEngineConfig(backend="p2p", engine_kwargs={"p2p": options})
        replicas = [ReplicaStandIn(i, s) for i, s in enumerate(servers)]
        manager = P2PCheckpointEngineManager(config, RayActorGroupStandIn(actors), replicas)
        yield World(manager, actors, pids, servers, rollout)
    finally:
        if manager is not None:
            manager.close()
        for pid in pids:  # a stopped rank (a failed "stop" case) ends with its actor below
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for actor in actors:
            ray.kill(actor)
        for server in servers:
            server.stop()
        if rollout is not None:
            rollout.close()


@pytest.mark.parametrize("fault", ["stop", "kill"])  # in this order: "kill" leaves rank 2 dead
def test_manager_bounds_a_rank_killed_or_stopped_inside_the_real_export(fault, world):
    report: dict[str, Any] = {"sync1_s": round(world.exact_sync(), 2)}
    plan = world.held(range(WORLD))
    assert {r: p["stage_ranks"] for r, p in plan.items()} == dict.fromkeys(range(WORLD), (0, 1, 2, 3))
    lost = {t for r in (VICTIM, PEER) for t in plan[r]["targets"]}  # what the victim's export group writes
    assert lost and not lost & {t for r in SURVIVORS for t in plan[r]["targets"]}
    stale = sorted({t.engine for t in lost})
    ray.get(world.actors[VICTIM].arm.remote(signal.SIGKILL if fault == "kill" else signal.SIGSTOP, AFTER))

    outcome, seconds = world.sync()
    report["sync2_s"] = round(seconds, 2)
    if fault == "kill":
        metrics = outcome
        assert isinstance(metrics, dict), f"the re-push did not recover the sync: {metrics}"
        assert seconds < DEADLINE_S + MARGIN_S, f"the sync took {seconds:.1f} s for a deadline of {DEADLINE_S} s"
        assert metrics[RETRIED] == float(len(lost)), metrics  # re-pushed within the sync
        assert world.rollout.wrong(f"sync{world.step}") == {}  # every target: SGLang's load of the checkpoint
        assert all(s.weight_version == str(world.step) and not s.paused for s in world.servers)
        repush = world.held((*SURVIVORS, PEER))  # the re-push's plan: the data-parallel copy wrote the lost targets
        assert {t for r in SURVIVORS for t in repush[r]["targets"]} == lost, repush
        assert all(repush[r]["stage_ranks"] == SURVIVORS for r in SURVIVORS), repush
        assert repush[PEER] == {"targets": (), "stage_ranks": (PEER,), "export": False}, repush  # cut off, idle
        with pytest.raises(ray.exceptions.RayActorError):  # it did die
            ray.get(world.actors[VICTIM].ready.remote(), timeout=60)
    else:
        try:
            _assert_bounded_and_named(outcome, seconds, lost, stale, world)
        finally:  # the victim resumes even when an assertion failed: the next case reuses the world
            os.kill(world.pids[VICTIM], signal.SIGCONT)
        resumed = time.monotonic()
        ray.get([world.actors[r].ready.remote() for r in (VICTIM, PEER)], timeout=GROUP_TIMEOUT_S + 60)
        report["late_calls_done_s"] = round(time.monotonic() - resumed, 2)  # behind them, Ray's queue
        report["sync3_s"] = round(world.exact_sync(), 2)  # the next full sync, every target exact
    print(f"megatron TP2 x DP2 {fault} through the manager: {report}")


def _assert_bounded_and_named(error: Any, seconds: float, lost: set, stale: list[int], world: World) -> None:
    """The stopped rank's sync: failed after one push deadline, naming it and every target left paused."""
    text = str(error)
    assert isinstance(error, SyncError), f"the sync did not fail: {error}"
    assert DEADLINE_S - 1 < seconds < DEADLINE_S + MARGIN_S, f"{seconds:.1f} s for a deadline of {DEADLINE_S} s"
    assert isinstance(error, SyncFailuresError) and "the run stops at once" in text, text  # a late rank
    assert f"trainer rank {VICTIM}: LateError" in text, text
    for target in sorted(lost, key=str):  # no other rank writes them while the late calls may still land
        assert f"{target}: not re-pushed: a write to it is still in flight from trainer rank" in text, text
    for rank in SURVIVORS:
        assert f"trainer rank {rank}:" not in text, text  # they completed: not named
    assert error.stale_engines == stale
    for engine, server in enumerate(world.servers):
        if engine in stale:  # paused, never resumed with unknown bytes
            assert server.paused and server.weight_version == str(world.step - 1), engine
        else:
            assert not server.paused and server.weight_version == str(world.step), engine

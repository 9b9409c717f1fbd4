"""R29 through the driver: the real P2PCheckpointEngineManager drives Ray actors, each ONE rank of a real gloo world,
each holding a real P2PCheckpointEngine whose push is the real SourceSession (go/no-go over p2p's bounded groups,
the export, Mooncake tcp writes) into receiver processes holding the rollout ranks' memory
(tests/support/manager_export_ranks.py, tests/test_stalled_rank_export.py's `Targets`). The victim signals itself
after 3 streamed tensors of a push.

Megatron-Bridge TP2 x DP2 (ranks {0, 1} and {2, 3} each export together; rank 2 the victim):
- kill (`p2p_push_retries=1`): its TP peer fails at once, Ray reports rank 2 dead; the manager's re-push plans
  around both and writes their targets through the data-parallel copy {0, 1}: `update_weights` returns within
  the push deadline plus MARGIN_S, every target's bytes what SGLang's loader holds from the checkpoint.
- stop: ranks 2 and 3 (waiting in its TP gather) are late; the sync fails after one push deadline, naming rank 2,
  their targets kept out of the re-push (their calls may still write, R30) and left paused, the others resumed;
  a late rank stops the run at once (SyncFailuresError, docs/failures.md "What the training job sees"). After
  SIGCONT the pair finishes its late call and the next full sync is exact on every target.

FSDP2 `fully_shard` on two ranks (rank 1 the victim): every rank's stream all-gathers with every other, so no rank
can re-push around the victim, and every target is written by both. The sync fails with SyncFailuresError, naming
the victim and both targets, every replica left paused at its old version:
- kill: the survivor's all-gather fails at once; the re-push is refused naming the ranks and the targets left
  paused, inside one push deadline. The job restarts (a new gloo world and manager, the same rollout): its first
  sync is exact.
- stop: both ranks are late (the survivor waits in the all-gather): the sync fails after one push deadline, the
  targets kept out of the re-push. After SIGCONT both finish their late calls (the replicas stay paused) and the
  next full sync is exact.
- stop_past_timeout: the same failure; the survivor leaves the all-gather at the trainer's group timeout
  (`Setup.group_timeout_s`, which p2p cannot shorten: gloo closes a group for good on a timeout), and the resumed
  victim finds that group closed: the job restarts, as after a kill.

Stand-ins, named as such: the rollout's control plane (tests/support/fake_sglang.py, one TP1 engine per receiver,
claiming the installed SGLang release, without weight-update sessions as that release; its rank info is the
receiver's session and weight addresses), verl's replicas (test_manager's ReplicaStandIn), verl's worker group
and actor worker (tests/support/deadline_ranks.py, tests/support/manager_export_ranks.py).

One world per trainer kind (`world`, parametrized indirectly: the Megatron world is torn down before the FSDP one
starts), its cases in an order that leaves it usable: the "stop" cases first (their victim comes back); a "kill"
leaves its victim dead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import ray
from support.deadline_ranks import RayActorGroupStandIn, start_rank
from support.fake_sglang import FakeSGLang, free_port
from support.manager_export_ranks import ExportRankWorker
from support.stalled_export import TP, Trainer, p2p_options
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

WORLD = 4  # Megatron TP2 x DP2
VICTIM, PEER, SURVIVORS = 2, 3, (0, 1)  # the victim's TP peer; the data-parallel copy
FSDP_VICTIM, FSDP_SURVIVOR = 1, 0
# p2p_push_deadline_s: a new gloo group of 4 ranks meets within it on a loaded 2-core host (4 s did not, at load 28)
DEADLINE_S = 8.0
MARGIN_S = 8.0  # the driver's round trips (a re-push's plan round, a new go/no-go group) on a busy 2-core host
AT_ONCE_S = 4.0  # a rank failing "at once": process scheduling on a busy 2-core host
AFTER = 3  # tensors the victim streams before its signal
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "stop_past_timeout": signal.SIGSTOP}
RETRIED = f"{PREFIX}retried_targets"


@dataclass(frozen=True)
class Setup:
    kind: str  # tests/support/stalled_export.py's Trainer.kind
    ranks: int  # trainer ranks
    group_timeout_s: float  # the trainer's own groups (the export's gathers run on them)
    tp: int = TP  # Megatron's tensor- and pipeline-parallel sizes
    pp: int = 1
    engines: int | None = None  # TP1 rollout engines (None: one per trainer rank)


SETUPS = {
    # longer than a "stop" lasts (one deadline and the driver's steps)
    "megatron": Setup("megatron", WORLD, 30.0),
    # the same, and the wait of "stop_past_timeout"
    "fsdp": Setup("fsdp", 2, 20.0),
    # tests/test_manager_transient_write.py: the layouts where only the ranks a write failed for can re-push it
    "megatron_one_rank_per_stage": Setup("megatron", 2, 30.0, tp=1, pp=2),
    "megatron_split_target": Setup("megatron", 2, 30.0, tp=1, engines=1),  # two data-parallel copies, one target
}


@dataclass
class World:
    """The trainer job (its ranks and the manager driving them) and the rollout it syncs (kept across restarts)."""

    setup: Setup
    model_dir: Path
    rollout: Any = None
    servers: list[FakeSGLang] = field(default_factory=list)
    manager: Any = None
    actors: list[Any] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    step: int = 0

    def launch(self) -> None:
        """Start the trainer ranks in a new gloo world (they build while the caller goes on)."""
        s = self.setup
        trainer = Trainer(s.kind, s.ranks, free_port(), str(self.model_dir), DEADLINE_S, s.group_timeout_s, s.tp, s.pp)
        self.options = {
            **p2p_options(trainer), "p2p_push_retries": 1, "p2p_prepare_deadline_s": 120.0, "http_timeout": 10
        }  # fmt: skip
        self.actors = [start_rank(ExportRankWorker, r, trainer, self.options) for r in range(s.ranks)]

    def join(self) -> None:
        """Wait for the ranks, then a new manager over them and the rollout's servers."""
        self.pids = ray.get([a.ready.remote() for a in self.actors], timeout=300)
        config = CheckpointEngineConfig(backend="p2p", engine_kwargs={"p2p": self.options})
        replicas = [ReplicaStandIn(i, s) for i, s in enumerate(self.servers)]
        self.manager = P2PCheckpointEngineManager(config, RayActorGroupStandIn(self.actors), replicas)

    def restart(self) -> float:
        """The job restarts: every rank and the manager anew, the rollout as the failure left it; seconds."""
        t0 = time.monotonic()
        self.end_job()
        self.launch()
        self.join()
        return time.monotonic() - t0

    def end_job(self) -> None:
        if self.manager is not None:
            self.manager.close()
            self.manager = None
        for pid in self.pids:  # a stopped rank (a failed "stop" case) ends with its actor below
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.pids = [], []

    def sync(self, before: Any = None) -> tuple[dict | SyncError, float]:
        """One `update_weights` after a 0xFF fill of every target (then `before()`, when given): (its metrics or
        its SyncError, seconds)."""
        self.rollout.fill()
        if before is not None:
            before()
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

    def pushed(self, ranks: Any, within: float) -> dict[int, tuple[str, float]]:
        """{rank: (outcome, seconds)} of each rank's last push, once its call (late, or resumed) has ended."""
        return dict(zip(ranks, ray.get([self.actors[r].pushed.remote() for r in ranks], timeout=within), strict=True))

    def assert_paused(self, stale: list[int]) -> None:
        """The engines in `stale` paused at the version before this sync (never resumed with unknown bytes), the
        others resumed at this sync's."""
        for engine, server in enumerate(self.servers):
            if engine in stale:
                assert server.paused and server.weight_version == str(self.step - 1), engine
            else:
                assert not server.paused and server.weight_version == str(self.step), engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from verl_p2p.sandbox.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def world(request, cluster, model_dir, tmp_path_factory):  # noqa: F811 - the imported fixture
    """The world of trainer kind `request.param` (SETUPS) with its rollout, one per kind for the module."""
    from verl_p2p.replica.rank_context import installed_sglang_version

    w = World(SETUPS[request.param], model_dir)
    try:
        w.launch()
        engines = w.setup.engines or w.setup.ranks
        w.rollout = Targets(model_dir, engines, tmp_path_factory.mktemp("dumps"))  # while the ranks build
        args = {SEED_FLAG: True, MEMORY_SAVER: False, "dtype": "float32"}
        for target in w.rollout.targets:  # engine e: receiver e's memory, published as SGLang's rank 0 would
            fake = FakeSGLang(tp_size=1, version=installed_sglang_version(), sessions=False, server_args=args)
            receiver = w.rollout.receivers[target]
            fake.rank_info = {0: [receiver.session_id, dict(receiver.weights_info)]}
            w.servers.append(fake)
        w.join()
        yield w
    finally:
        w.end_job()
        for server in w.servers:
            server.stop()
        if w.rollout is not None:
            w.rollout.close()


@pytest.mark.parametrize("world", ["megatron"], indirect=True)
@pytest.mark.parametrize("fault", ["stop", "kill"])  # in this order: "kill" leaves rank 2 dead
def test_manager_bounds_a_rank_killed_or_stopped_inside_the_real_export(fault, world):
    report: dict[str, Any] = {"sync1_s": round(world.exact_sync(), 2)}
    plan = world.held(range(WORLD))
    assert {r: p["stage_ranks"] for r, p in plan.items()} == dict.fromkeys(range(WORLD), (0, 1, 2, 3))
    lost = {t for r in (VICTIM, PEER) for t in plan[r]["targets"]}  # what the victim's export group writes
    assert lost and not lost & {t for r in SURVIVORS for t in plan[r]["targets"]}
    stale = sorted({t.engine for t in lost})
    ray.get(world.actors[VICTIM].arm.remote(SIGNALS[fault], AFTER))

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
        ray.get([world.actors[r].ready.remote() for r in (VICTIM, PEER)], timeout=world.setup.group_timeout_s + 60)
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
    world.assert_paused(stale)


@pytest.mark.parametrize("world", ["fsdp"], indirect=True)
# in this order: "kill" restarts the job (its victim is dead); "stop_past_timeout" closes the trainer's group
@pytest.mark.parametrize("fault", ["stop", "kill", "stop_past_timeout"])
def test_manager_fails_an_fsdp_sync_inside_one_deadline_when_a_rank_is_killed_or_stopped(fault, world):
    victim, survivor, ranks = FSDP_VICTIM, FSDP_SURVIVOR, (FSDP_SURVIVOR, FSDP_VICTIM)
    group_timeout_s = world.setup.group_timeout_s
    report: dict[str, Any] = {"deadline_s": DEADLINE_S, "sync1_s": round(world.exact_sync(), 2)}
    assert [s.export_peers for s in world.manager._sources] == [None, None]  # every rank gathers with every rank
    plan = world.held(ranks)
    assert all(p["stage_ranks"] == ranks and p["export"] for p in plan.values()), plan
    targets = world.rollout.targets
    assert {t for p in plan.values() for t in p["targets"]} == set(targets), plan
    stale = [t.engine for t in targets]  # no rank can write a target without the victim
    ray.get(world.actors[victim].arm.remote(SIGNALS[fault], AFTER))

    error, seconds = world.sync()
    report["sync2_failed_s"] = round(seconds, 2)
    text = str(error)
    try:
        assert isinstance(error, SyncFailuresError) and "the run stops at once" in text, f"not stopped: {error}"
        assert error.count == 1, text  # the first failed sync stops the run: no sync again with a rank lost
        assert error.stale_engines == stale, text
        world.assert_paused(stale)  # never resumed with unknown or half-written bytes
        if fault == "kill":
            assert seconds < DEADLINE_S + MARGIN_S, f"{seconds:.1f} s for a deadline of {DEADLINE_S} s"
            assert f"trainer rank {victim}: ActorDiedError" in text, text  # Ray's RayActorError: the actor died
            outcome, pushed_s = world.pushed((survivor,), 60)[survivor]  # its all-gather with a dead peer
            assert "Connection closed by peer" in outcome or "Connection reset" in outcome, outcome
            assert pushed_s < AT_ONCE_S, f"rank {survivor}: {pushed_s:.2f} s"
            report["survivor_returned_s"] = round(pushed_s, 2)
            # the re-push is refused before any call: no rank exports without the victim
            assert f"can export without trainer rank(s) [{victim}]" in text, text
            assert f"ranks [{survivor}] run with them" in text, text
            assert f"Left paused with weights unknown: {', '.join(map(str, targets))}" in text, text
        else:
            assert DEADLINE_S - 1 < seconds < DEADLINE_S + MARGIN_S, f"{seconds:.1f} s for {DEADLINE_S} s"
            for rank in ranks:  # the survivor waits in FSDP's all-gather: late too
                assert f"trainer rank {rank}: LateError" in text, text
            for target in targets:  # no rank writes them while the late calls may still land
                assert f"{target}: not re-pushed: a write to it is still in flight from trainer rank" in text, text
    finally:  # the victim resumes even when an assertion failed
        if fault == "stop":
            stopped = time.monotonic()
            os.kill(world.pids[victim], signal.SIGCONT)

    if fault == "stop":
        late = world.pushed(ranks, group_timeout_s + 60)
        report["late_calls_done_s"] = round(time.monotonic() - stopped, 2)  # behind them, Ray's queue
        report["late_push_s"] = {r: round(s, 2) for r, (_, s) in late.items()}
        assert late[survivor][0] == "ok", late  # the stop ended before the group timeout: the gathers completed
        assert late[survivor][1] > DEADLINE_S - 1, late  # it waited for the victim past p2p's deadline
        # a write the victim had in flight while stopped may have outlived p2p_transfer_timeout
        outcome = late[victim][0]
        assert outcome == "ok" or ("TransferError" in outcome and "unknown" in outcome), late
        world.assert_paused(stale)  # the late calls wrote, the manager resumed nothing
        report["sync3_s"] = round(world.exact_sync(), 2)
    elif fault == "stop_past_timeout":  # the trainer's group timeout, not p2p's deadline, ends the survivor's wait
        outcome, pushed_s = world.pushed((survivor,), group_timeout_s + 60)[survivor]
        assert "Timed out" in outcome, outcome
        assert group_timeout_s - 1 < pushed_s < group_timeout_s + AT_ONCE_S, f"rank {survivor}: {pushed_s:.2f} s"
        report["survivor_returned_s"] = round(pushed_s, 2)
        os.kill(world.pids[victim], signal.SIGCONT)  # gloo closed the group: the resumed rank's gather fails too
        outcome, pushed_s = world.pushed((victim,), 60)[victim]
        assert "closure" in outcome or "closed" in outcome, outcome
        report["victim"] = outcome.splitlines()[0][-60:]
    else:
        with pytest.raises(ray.exceptions.RayActorError):  # it did die
            ray.get(world.actors[victim].ready.remote(), timeout=60)
        report["restart_s"] = round(world.restart(), 2)
        report["sync3_s"] = round(world.exact_sync(), 2)  # the restarted job's first sync: every target exact
    print(f"fsdp2 {fault} through the manager: {report}")

"""The re-push policy of P2PCheckpointEngineManager with one call per trainer rank, as verl's RayWorkerGroup makes
them (review findings R28, R30).

R28: a rank whose error names the rollout targets that failed is a healthy sender and stays eligible for the
re-push, so `p2p_push_retries` recovers a transient write failure with one trainer rank per pipeline stage, for a
split target whose rollout rank failed for every sender, and under FSDP (every rank writes a part of every target).
R30: a target a write call may still land in (refused for a call still in flight, or a late rank's) is given to no
other rank in the same sync: it stays paused and named; the next sync writes it once that call returned.

Stand-ins (named as such): the SGLang servers (tests/support/fake_sglang.py), verl's replicas and the trainer's data
plane (test_manager's SourceSessionStandIn, scripted here), verl's actor worker group (its calls run in-process on
real P2PCheckpointEngine objects; each rank's exception reaches the driver as Ray delivers it: pickled inside Ray's
RayTaskError by Ray's cloudpickle), and, for the in-flight refusal, the transport under a real Writer.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import ray.cloudpickle
import verl  # noqa: F401
from ray.exceptions import RayTaskError
from support.fake_sglang import FakeSGLang
from test_manager import ReplicaStandIn, SourceSessionStandIn
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.workers.config import CheckpointEngineConfig

from verl_p2p.backend.manager import P2PCheckpointEngineManager
from verl_p2p.backend.roles import TrainerIdentity
from verl_p2p.errors import TransferError
from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo, TargetRank
from verl_p2p.rollout.launch import MEMORY_SAVER, SEED_FLAG
from verl_p2p.rollout.lifecycle import SyncError
from verl_p2p.transfer.writer import InFlightCalls, TargetFailure, WriteEntry, Writer, push_error

RETRIED = "checkpoint_engine/p2p/retried_targets"


class ScriptedSession(SourceSessionStandIn):
    """The SourceSession stand-in whose push raises what `script(rank, targets)` returns (None: it writes as the
    stand-in does); every push is journaled as (sync, rank, targets, wrote)."""

    script = None
    journal: list = []
    sync = 0

    def push(self, weights=None):
        assignment = self.applied[-1]
        error = ScriptedSession.script(assignment.rank, assignment.targets) if ScriptedSession.script else None
        ScriptedSession.journal.append((ScriptedSession.sync, assignment.rank, tuple(assignment.targets), not error))
        if error is not None:
            raise error
        return super().push()


async def as_ray_delivers(call):
    """A rank's call as `ray.get` answers it: its value, or its exception pickled inside RayTaskError (what
    crosses from the worker to the driver) and raised as the dual RayTaskError(cause type)."""
    try:
        return await call
    except Exception as exc:  # noqa: BLE001 - every rank's exception crosses as Ray carries it
        wrapped = RayTaskError("update_weights", "Traceback (stand-in)", exc, "ray::Worker", 1, "127.0.0.1")
        raise ray.cloudpickle.loads(ray.cloudpickle.dumps(wrapped)).as_instanceof_cause() from None


class RankGroupStandIn:
    """Stand-in for verl's actor RayWorkerGroup: one call per rank (DP_COMPUTE), run on local engines. `late`:
    ranks whose push does not answer (a rank hung in its export; the driver's deadline gives up on it)."""

    def __init__(self, identities: list[TrainerIdentity], full_stream: bool = False):
        self.engines = []
        for me in identities:
            engine = CheckpointEngineRegistry.new("p2p", is_master=me.rank == 0, bucket_size=1 << 20)
            engine._trainer = me
            engine._full_stream = full_stream  # verl's FSDP engine: every rank streams the whole model
            self.engines.append(engine)
        self.world_size = len(identities)
        self.late: set[int] = set()
        self.pushes = 0

    def execute_checkpoint_engine(self, method, **kwargs):
        return [
            getattr(engine, name)(**{k: v[i] for k, v in kwargs.items()})
            for i, (engine, name) in enumerate(zip(self.engines, method, strict=True))
        ]

    def update_weights(self, global_steps=None, mode="auto"):
        assert mode == "p2p"
        self.pushes += 1
        return [
            as_ray_delivers(self._hang() if i in self.late else e.send_weights(None, global_steps=global_steps))
            for i, e in enumerate(self.engines)
        ]

    @staticmethod
    async def _hang():
        await asyncio.sleep(60)


@pytest.fixture
def world(monkeypatch):
    """make(identities, tp_size, full_stream, **options): the manager over one FakeSGLang engine of `tp_size`
    ranks and a RankGroupStandIn of those trainer ranks; p2p_push_retries=1."""
    made = []
    monkeypatch.setattr("verl_p2p.trainer.source.SourceSession", ScriptedSession)
    monkeypatch.setattr(ScriptedSession, "script", None)
    monkeypatch.setattr(ScriptedSession, "journal", [])

    def make(identities, tp_size=1, full_stream=False, **options):
        server = FakeSGLang(tp_size=tp_size, server_args={SEED_FLAG: True, MEMORY_SAVER: False})
        monkeypatch.setattr(ScriptedSession, "servers", {0: server})
        group = RankGroupStandIn(identities, full_stream)
        config = CheckpointEngineConfig(
            backend="p2p", engine_kwargs={"p2p": {"http_timeout": 10, "p2p_push_retries": 1, **options}}
        )
        manager = P2PCheckpointEngineManager(config, group, [ReplicaStandIn(0, server)])
        made.append((manager, server))
        return manager, group, server

    yield make
    for manager, server in made:
        manager.close()
        server.stop()


def sync(manager, version):
    ScriptedSession.sync = version
    return manager.update_weights(global_steps=version)


def timeout_error(target: TargetRank) -> TransferError:
    """What the trainer's Writer raises when a write to `target` passed p2p_transfer_timeout."""
    return push_error([TargetFailure(target, "127.0.0.1:17000", "write timed out after 2 s (p2p_transfer_timeout)")])


def fail_once_each(target: TargetRank, ranks):
    """A script: the first push of each of `ranks` that writes `target` fails with a write timeout to it."""
    pending = set(ranks)

    def script(rank, targets):
        if rank in pending and target in targets:
            pending.discard(rank)
            return timeout_error(target)
        return None

    return script


def writers(version, target):
    """The ranks that wrote `target` in sync `version` (every push and re-push), in order."""
    return [rank for v, rank, targets, wrote in ScriptedSession.journal if v == version and target in targets and wrote]


def assert_resumed_at(server, version):
    assert server.weight_version == str(version) and not server.paused and server.violations == []


@pytest.mark.parametrize("pp_size", [1, 2], ids=["one_rank", "one_rank_per_stage"])
def test_one_rank_per_stage_re_pushes_a_transient_write_timeout(world, pp_size):
    """R28: with one trainer rank per pipeline stage the rank whose write timed out is the only one that can send
    its stage: the re-push gives it the target again and the sync succeeds (before the fix: 'no trainer rank of
    pipeline stage(s) [..] can send', the replica paused and stale)."""
    manager, group, server = world([TrainerIdentity(r, pp_size, r, pp_size) for r in range(pp_size)])
    sync(manager, 1)
    target, victim = TargetRank(0, 0), pp_size - 1
    ScriptedSession.script = fail_once_each(target, [victim])
    metrics = sync(manager, 2)
    assert metrics[RETRIED] == 1.0
    assert victim in writers(2, target)  # its push failed: it wrote the target in the re-push
    assert_resumed_at(server, 2)


def test_a_split_target_failing_for_every_sender_is_re_pushed_by_them(world):
    """R28: two ranks of one stage split the one target; its rollout rank times out for both. Neither rank is at
    fault: both write their parts again in the re-push (before the fix both were excluded and the sync failed)."""
    manager, group, server = world([TrainerIdentity(r, 2, 0, 1) for r in range(2)])
    sync(manager, 1)
    target = TargetRank(0, 0)
    assert sorted(writers(1, target)) == [0, 1]  # a split target: each rank writes a part
    ScriptedSession.script = fail_once_each(target, [0, 1])
    metrics = sync(manager, 2)
    assert metrics[RETRIED] == 1.0 and group.pushes == 3  # sync 1, the push, the re-push
    assert sorted(writers(2, target)) == [0, 1]
    assert_resumed_at(server, 2)


def test_fsdp_ranks_re_push_a_rollout_rank_that_timed_out_for_all_of_them(world):
    """R28 under FSDP (SourceMeta.full_stream: every rank writes a part of every target): one slow rollout rank
    fails every trainer rank's push at once; the re-push gives each its part again and the sync succeeds."""
    manager, group, server = world([TrainerIdentity(r, 3, 0, 1) for r in range(3)], tp_size=2, full_stream=True)
    sync(manager, 1)
    slow = TargetRank(0, 1)
    assert sorted(writers(1, slow)) == [0, 1, 2] and sorted(writers(1, TargetRank(0, 0))) == [0, 1, 2]
    ScriptedSession.script = fail_once_each(slow, [0, 1, 2])
    metrics = sync(manager, 2)
    assert metrics[RETRIED] == 1.0
    assert sorted(writers(2, slow)) == [0, 1, 2]
    assert_resumed_at(server, 2)


class BlockingTransport:
    """Stand-in for a Mooncake endpoint whose write into a frozen peer blocks in the transport until `thaw`."""

    session_id = "127.0.0.1:16000"

    def __init__(self) -> None:
        self.frozen = threading.Event()
        self.frozen.set()

    def register(self, addr, nbytes):
        pass

    def unregister(self, addr):
        pass

    def write(self, session_id, local_addrs, remote_addrs, lengths):
        while self.frozen.is_set():
            time.sleep(0.01)

    def thaw(self):
        self.frozen.clear()


def in_flight_refusal(target: TargetRank) -> tuple[BaseException, BlockingTransport]:
    """The refusal a trainer rank's real Writer raises for `target` while its earlier call to it is blocked: one
    Writer's write times out (its call stays in the transport), a later plan's Writer of the same rank refuses."""
    info = RemoteRankInfo("127.0.0.1:17000", {"w": RemoteParam(0x7F0000000000, 1024, 2)})
    entry = WriteEntry(target, "w", 0, 0x10000, 2048)
    transport, calls = BlockingTransport(), InFlightCalls()
    first = Writer(transport, {target: info}, timeout_s=0.2, inflight=calls)
    with pytest.raises(TransferError, match="timed out"):
        first.write([entry])
    later = Writer(transport, {target: info}, timeout_s=0.2, inflight=calls)
    with pytest.raises(TransferError, match="still in flight") as refused:
        later.write([entry])
    return refused.value, transport


def test_a_target_with_a_write_still_in_flight_is_given_to_no_other_rank(world):
    """R30: rank 0 refuses its target because its own earlier write call to it is still blocked (the real Writer's
    refusal). The re-push must not hand that target to rank 1 (the old call could land older bytes over rank 1's
    after the replica resumed): it stays paused, named with the rank holding the call. Once that call returned,
    the next sync writes it and resumes the replica."""
    manager, group, server = world([TrainerIdentity(r, 2, 0, 1) for r in range(2)], tp_size=2)
    sync(manager, 1)
    busy = TargetRank(0, 0)
    assert writers(1, busy) == [0] and writers(1, TargetRank(0, 1)) == [1]
    refusal, transport = in_flight_refusal(busy)
    try:
        ScriptedSession.script = lambda rank, targets: refusal if busy in targets and rank == 0 else None
        with pytest.raises(SyncError) as info:
            sync(manager, 2)
        text = str(info.value)
        assert writers(2, busy) == [], f"the re-push handed {busy} to rank(s) {writers(2, busy)}"
        assert info.value.stale_engines == [0] and server.paused and server.weight_version == "1"
        assert f"{busy}: not re-pushed: a write to it is still in flight from trainer rank 0" in text, text
    finally:
        transport.thaw()
    ScriptedSession.script = None  # the call returned: rank 0 writes its target again
    sync(manager, 3)
    assert writers(3, busy) == [0]
    assert_resumed_at(server, 3)


def test_a_late_ranks_targets_are_not_re_pushed_by_another_rank(world):
    """A rank that did not answer within p2p_push_deadline_s may still be writing: its targets are given to no
    other rank in the same sync (stay paused, named as held by that rank); the next sync, the rank answering
    again, writes them."""
    manager, group, server = world(
        [TrainerIdentity(r, 2, 0, 1) for r in range(2)], tp_size=2, p2p_push_deadline_s=1.0, p2p_transfer_timeout=0.5
    )
    sync(manager, 1)
    theirs = TargetRank(0, 1)
    assert writers(1, theirs) == [1]
    group.late = {1}
    with pytest.raises(SyncError) as info:
        sync(manager, 2)
    text = str(info.value)
    assert writers(2, theirs) == [], f"the re-push handed the late rank's {theirs} to rank(s) {writers(2, theirs)}"
    assert info.value.stale_engines == [0] and server.paused and server.weight_version == "1"
    assert f"{theirs}: not re-pushed: a write to it is still in flight from trainer rank 1" in text, text
    assert "did not answer within p2p_push_deadline_s=1 s" in text, text
    group.late = set()
    sync(manager, 3)
    assert writers(3, theirs) == [1]
    assert_resumed_at(server, 3)

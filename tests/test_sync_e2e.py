"""Issue #3's acceptance on the loopback rollout: the driver's sync lifecycle over three real engines in parallel.

Three loopback engines (TP2/EP2, TP1, TP1; SGLang's real model classes and loader, one process per rank) claim
SGLang 0.5.23, so they have begin/end weight-update sessions. The push is `MirrorPush` (tests/support/
sync_mirror.py): real one-sided Mooncake tcp writes through verl_p2p's Writer of each rank's own start-up weights
scaled per sync; it needs no trainer-side replica, which refuses a server claiming another SGLang release than the
installed 0.5.12 (the demo, tests/test_demo_e2e.py, covers SourceSession + replica end to end). Everything else is
the production path: SyncLifecycle, P2PReplicaAdapter, SGLangClient, WeightUpdateChecker.

The engines start once for the module. Test order matters: the freeze test thaws its rank and recovers the
engine; the kill test is destructive and runs last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest
from support.sync_mirror import MirrorPush

from verl_p2p.config import P2PConfig
from verl_p2p.loopback.engine import EngineSpec, loopback_engines
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.lifecycle import SyncError, SyncLifecycle
from verl_p2p.sandbox.tiny import write_tiny_checkpoint

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytestmark = pytest.mark.slow

SESSIONS_VERSION = "0.5.23"  # first release imitated with /begin_weight_update and /end_weight_update is 0.5.21
SPECS = [  # engine index = position
    EngineSpec(tp=2, ep=2, sglang_version=SESSIONS_VERSION, rank_timeout_s=6),
    EngineSpec(tp=1, sglang_version=SESSIONS_VERSION, rank_timeout_s=6),
    EngineSpec(tp=1, sglang_version=SESSIONS_VERSION, rank_timeout_s=6),
]
TRANSFER_TIMEOUT_S = 3.0
CONFIG = P2PConfig(protocol="tcp", hostname="127.0.0.1", p2p_transfer_timeout=TRANSFER_TIMEOUT_S, http_timeout=20.0)

SYNC_SEQUENCE = [
    ("POST", "/pause_generation"),
    ("POST", "/release_memory_occupation"),
    ("POST", "/begin_weight_update"),
    ("POST", "/update_weight_version"),
    ("POST", "/end_weight_update"),
    ("POST", "/resume_memory_occupation"),
    ("POST", "/continue_generation"),
]
RANK_READ = "/remote_instance_transfer_engine_info"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("sync_e2e") / "qwen3_moe", "qwen3_moe", id_encoded=False)
    start = time.monotonic()
    with loopback_engines(SPECS, str(model)) as started:
        print(f"3 engines ready in {time.monotonic() - start:.1f} s")
        yield started


@pytest.fixture(scope="module")
def mirror(engines):
    pusher = MirrorPush(engines, timeout_s=TRANSFER_TIMEOUT_S)
    yield pusher
    pusher.close()


def make_lifecycle(engines, config=CONFIG, bootstrap=False):
    """Adapters read rank info through each control plane (bootstrap=False), so the reads are in events()."""
    adapters = [
        P2PReplicaAdapter(i, e.url, bootstrap_url=e.bootstrap_url if bootstrap else None, config=config)
        for i, e in enumerate(engines)
    ]
    return SyncLifecycle(adapters, config, frees_kv=True)


def marks(engines):
    return [len(e.events()) for e in engines]


def calls(events):
    """The lifecycle's state-changing calls (every POST), in arrival order."""
    return [e for e in events if e["method"] == "POST"]


def versions(lifecycle):
    async def read():
        return await asyncio.gather(*(a.client.weight_version() for a in lifecycle.adapters))

    return asyncio.run(read())


def assert_restored(engine, events, after: float) -> None:
    """end, resume KV and continue ran on `engine` after wall time `after`, all successful, generation running."""
    later = [(e["path"], e["status"]) for e in calls(events) if e["time"] >= after]
    assert later == [
        ("/end_weight_update", 200),
        ("/resume_memory_occupation", 200),
        ("/continue_generation", 200),
    ], later
    state = events[-1]["state"]
    assert not state["paused"] and not state["session_open"] and state["released_tags"] == []


# -------------------------------------------------------------------------------------------------- tests


def test_lifecycle_order_on_three_engines_in_parallel(engines, mirror):
    """Each engine's state machine sees exactly pause -> release KV -> begin -> bump -> end -> resume KV -> continue,
    all successful; every rank's info is read before the push; the push lands inside the session; every step
    ran on all three engines before the next step started on any; the weights are bit-exact afterwards."""
    lifecycle = make_lifecycle(engines)
    try:
        for version, scale in ((1, 1.25), (2, 1.5)):  # the first sync connects, the second reuses the connection
            since = marks(engines)
            report = asyncio.run(lifecycle.sync(version, mirror.push(scale)))
            assert report.reconnected == (version == 1) and report.engines_without_sessions == []
            assert mirror.num_batches > 3  # the push really is several batches (64 KiB per target each)
            steps = []
            for engine, mark in zip(engines, since, strict=True):
                events = engine.events(mark)
                seq = calls(events)
                assert [(e["method"], e["path"]) for e in seq] == SYNC_SEQUENCE, engine.url
                assert all(e["status"] == 200 for e in events), [(e["path"], e["status"]) for e in events]
                pause, release, begin, bump, end, resume_kv, cont = seq
                assert pause["body"] == {"mode": "abort"} and release["body"] == {"tags": ["kv_cache"]}
                assert bump["body"] == {"new_version": str(version), "abort_all_requests": False}
                assert begin["state"]["session_open"] and bump["state"]["session_open"]
                assert bump["state"]["weight_version"] == str(version)
                assert not end["state"]["session_open"] and not cont["state"]["paused"]
                assert resume_kv["state"]["released_tags"] == [] and release["state"]["released_tags"] == ["kv_cache"]
                # the one-sided writes happened inside the session, before the version moved
                assert begin["time"] <= mirror.started and mirror.finished <= bump["time"]
                # every rank's published info was (re-)read, overlapped with abort..begin, before the push
                reads = [e for e in events if e["path"] == RANK_READ]
                assert len(reads) == engine.spec.tp and all(e["time"] <= mirror.started for e in reads)
                assert [e["path"] for e in events if e["method"] == "GET" and e["path"] != RANK_READ] == (
                    ["/server_info"] if version == 1 else []
                )
                steps.append(seq)
            for i in range(len(SYNC_SEQUENCE) - 1):  # lockstep: step i done everywhere before step i+1 anywhere
                assert max(s[i]["time"] for s in steps) <= min(s[i + 1]["time"] for s in steps), SYNC_SEQUENCE[i]
            assert mirror.mismatches(scale) == []
        assert versions(lifecycle) == ["2", "2", "2"]
    finally:
        lifecycle.close()


def test_weight_check_passes_then_a_flipped_byte_fails_the_compare(engines, mirror):
    """check_weight_update_equal: snapshot + reset before the first sync, compare after it passes on every engine.
    A second armed cycle whose push leaves one flipped byte on one rank fails the compare naming the tensor."""
    config = dataclasses.replace(CONFIG, check_weight_update_equal=True)
    scale = mirror.held_scale  # the snapshot is what the engines hold now: the push must write exactly that
    lifecycle = make_lifecycle(engines, config)
    try:
        since = marks(engines)
        report = asyncio.run(lifecycle.sync(3, mirror.push(scale)))
        assert "check_arm" in report.phases and "check_compare" in report.phases
        for engine, mark in zip(engines, since, strict=True):
            events = engine.events(mark)
            checks = [e["body"]["action"] for e in events if e["path"] == "/weights_checker"]
            assert checks == ["snapshot", "reset_tensors", "compare"] and all(e["status"] == 200 for e in events)
            paths = [e["path"] for e in calls(events)]
            assert paths.index("/release_memory_occupation") < paths.index("/weights_checker")
            assert paths.index("/begin_weight_update") == paths.index("/weights_checker") + 2  # after reset
            assert paths[-3:] == ["/weights_checker", "/resume_memory_occupation", "/continue_generation"]
        assert mirror.mismatches(scale) == []
    finally:
        lifecycle.close()

    name, victim = "model.layers.1.self_attn.o_proj.weight", engines[2]
    flipped = []

    def corrupt() -> None:  # after the push's writes, before the lifecycle's compare
        flipped.append(victim.flip_byte(0, name, 7))

    lifecycle = make_lifecycle(engines, config)
    mirror.after_write = corrupt
    since = marks(engines)
    try:
        with pytest.raises(SyncError) as failed:
            asyncio.run(lifecycle.sync(4, mirror.push(scale)))
    finally:
        mirror.after_write = None
        lifecycle.close()
    text = str(failed.value)
    print(f"flipped byte:\n{text}")
    assert failed.value.failures[0].step == "check_compare" and flipped
    assert f"compare failed on engine 2 ({victim.url})" in text and f"name={name} " in text
    assert "engine 0" not in text and "engine 1" not in text  # the others compared equal
    for engine, mark in zip(engines, since, strict=True):
        events = engine.events(mark)
        compare = [e for e in events if e["path"] == "/weights_checker"][-1]
        assert compare["status"] == (400 if engine is victim else 200)
        assert not events[-1]["state"]["paused"] and events[-1]["path"] == "/continue_generation"
    assert mirror.mismatches(scale) == [f"engine 2 rank 0: {name}"]
    victim.flip_byte(0, name, 7)  # flip it back
    assert mirror.mismatches(scale) == []


def test_frozen_rank_is_bounded_by_p2p_transfer_timeout(engines, mirror):
    """A rank frozen (SIGSTOP) mid-push: the push fails p2p_transfer_timeout after the freeze naming that engine,
    rank and session; the other engines are ended and resumed at once (not held back by the frozen engine's own
    stuck end), got all their bytes, and no version moves; thawed, the engine recovers and the next sync works."""
    lifecycle = make_lifecycle(engines, bootstrap=True)
    victim, scale = engines[1], mirror.held_scale + 0.25
    session = asyncio.run(lifecycle.adapters[1].rank_infos())[0].session_id
    frozen_at = []

    def freeze(batch: int) -> None:
        if batch == 0:
            victim.freeze_rank(0)
            frozen_at.append(time.time())

    before = versions(lifecycle)
    since = marks(engines)
    mirror.after_batch = freeze
    try:
        with pytest.raises(SyncError) as failed:
            asyncio.run(lifecycle.sync(5, mirror.push(scale)))
        raised_at = time.time()
    finally:
        mirror.after_batch = None
        victim.thaw_rank(0)
    error = failed.value
    push_failed = mirror.finished - frozen_at[0]
    print(f"frozen: push failed {push_failed:.2f} s, sync raised {raised_at - frozen_at[0]:.2f} s after the freeze")
    print(error)
    assert error.failures[0].step == "push"
    assert f"engine 1 rank 0 (session {session}): write of" in str(error)
    assert f"timed out after {TRANSFER_TIMEOUT_S:g} s" in str(error)
    assert "engine 0 rank" not in str(error.failures[0]) and "engine 2 rank" not in str(error.failures[0])
    # the push gave up one deadline after the freeze (+ margin for this shared 2-core machine)
    assert TRANSFER_TIMEOUT_S - 0.1 <= push_failed <= TRANSFER_TIMEOUT_S + 2.5, push_failed
    # the frozen engine cannot end its session (its rank does not answer) and so cannot resume: both named. Its
    # end is bounded by the control plane (the loopback's rank timeout, 6 s here; http_timeout otherwise).
    assert [(f.step, f.engine) for f in error.cleanup] == [("end", 1), ("resume", 1)], error.cleanup
    assert raised_at - frozen_at[0] <= TRANSFER_TIMEOUT_S + SPECS[1].rank_timeout_s + 4.0
    for index in (0, 2):
        events = engines[index].events(since[index])
        assert "/update_weight_version" not in [e["path"] for e in events]
        assert_restored(engines[index], events, after=mirror.finished)
        resumed = calls(events)[-1]["time"] - mirror.finished
        assert resumed < 2.0, f"engine {index} resumed {resumed:.2f} s after the push failed"
    assert mirror.mismatches(scale, engines=[0, 2]) == []  # the other targets still got every byte

    # thawed: the stuck session is closed by hand, generation resumed, and the next sync rewrites everything
    adapter = lifecycle.adapters[1]
    assert asyncio.run(adapter.end_session()) is True
    asyncio.run(adapter.resume())
    assert versions(lifecycle) == before
    report = asyncio.run(lifecycle.sync(6, mirror.push(scale)))
    assert not report.reconnected and mirror.mismatches(scale) == []
    assert versions(lifecycle) == ["6", "6", "6"]
    lifecycle.close()


def test_killed_rank_mid_push_fails_the_sync_and_restores_the_others(engines, mirror):
    """Destructive, keep last. Engine 0's rank 1 is SIGKILLed after the push's first batch: the sync raises
    naming engine 0 rank 1 and its session, engines 1 and 2 are ended and resumed (generation running) and got
    all their bytes, and no engine's weight version moved."""
    lifecycle = make_lifecycle(engines, bootstrap=True)
    victim, scale = engines[0], mirror.held_scale + 0.25
    session = asyncio.run(lifecycle.adapters[0].rank_infos())[1].session_id

    def kill(batch: int) -> None:
        if batch == 0:
            victim.kill_rank(1)

    before = versions(lifecycle)
    since = marks(engines)
    mirror.after_batch = kill
    try:
        with pytest.raises(SyncError) as failed:
            asyncio.run(lifecycle.sync(7, mirror.push(scale)))
    finally:
        mirror.after_batch = None
    error = failed.value
    print(f"killed:\n{error}")
    assert error.failures[0].step == "push" and mirror.num_batches > 1
    assert "weight sync to version '7' failed at push" in str(error)
    assert f"engine 0 rank 1 (session {session})" in str(error.failures[0])
    assert "engine 0 rank 0" not in str(error.failures[0])  # its other rank, and the other engines, got all bytes
    # engine 0 cannot end its session (rank 1 is gone), so it is not resumed: both named while restoring
    assert [(f.step, f.engine) for f in error.cleanup] == [("end", 0), ("resume", 0)], error.cleanup
    assert "rank 1 is dead" in str(error.cleanup[0])
    for index in (1, 2):
        events = engines[index].events(since[index])
        assert "/update_weight_version" not in [e["path"] for e in events]
        assert_restored(engines[index], events, after=mirror.finished)
    assert versions(lifecycle) == before
    assert mirror.mismatches(scale, engines=[1, 2]) == []
    lifecycle.close()

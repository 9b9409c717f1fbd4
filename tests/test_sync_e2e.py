"""Issue #3's acceptance on the loopback rollout: the driver's sync lifecycle over three real engines in parallel.

Three loopback engines (TP2/EP2, TP1, TP1; SGLang's real model classes and loader, one process per rank) claim
SGLang 0.5.23, so they have begin/end weight-update sessions. The push is the loopback's stand-in trainer
(`verl_p2p/loopback/mirror_push.py`): real one-sided Mooncake tcp writes through verl_p2p's Writer of each rank's
own start-up weights scaled per sync; it needs no trainer-side replica, which refuses a server claiming another
SGLang release than the installed 0.5.12 (the demo, tests/test_demo_e2e.py, covers SourceSession + replica end to
end). Everything else is the production path: SyncLifecycle, P2PReplicaAdapter, SGLangClient, WeightUpdateChecker.

The loopback is as lenient as SGLang: continue_generation resumes whatever state an engine is in, and records
what p2p must never do (a stale prefix cache served, generation resumed inside a session) as violations, which
every test here checks for.

The engines start once for the module. Test order matters: the freeze tests thaw their rank and the next sync
recovers the engine; the kill test is destructive and runs last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest

from verl_p2p.config import P2PConfig
from verl_p2p.loopback.engine import EngineSpec, loopback_engines
from verl_p2p.loopback.mirror_push import MirrorPush
from verl_p2p.planning.targets import TargetRank
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
    ("POST", "/flush_cache"),
    ("POST", "/continue_generation"),
]
KEEPS_KV = [c for c in SYNC_SEQUENCE if "memory_occupation" not in c[1]]  # P2PCheckpointEngineManager's mode
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
    pusher = MirrorPush.of_engines(engines, timeout_s=TRANSFER_TIMEOUT_S)
    yield pusher
    pusher.close()


def make_lifecycle(engines, config=CONFIG, bootstrap=False, frees_kv=True):
    """Adapters read rank info through each control plane (bootstrap=False), so the reads are in events()."""
    adapters = [
        P2PReplicaAdapter(i, e.url, bootstrap_url=e.bootstrap_url if bootstrap else None, config=config)
        for i, e in enumerate(engines)
    ]
    return SyncLifecycle(adapters, config, frees_kv=frees_kv)


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
    """Version, end, resume KV, flush and continue ran on `engine` after wall time `after`, all successful, and
    it generates again with a fresh prefix cache."""
    later = [(e["path"], e["status"]) for e in calls(events) if e["time"] >= after]
    assert later == [
        ("/update_weight_version", 200),
        ("/end_weight_update", 200),
        ("/resume_memory_occupation", 200),
        ("/flush_cache", 200),
        ("/continue_generation", 200),
    ], later
    state = engine.state()
    assert not state["paused"] and not state["session_open"] and state["released_tags"] == []
    assert [e["path"] for e in events if e["method"] == "LOOPBACK"] == []  # no violation


def assert_parked(engine, events, version: str) -> None:
    """A stale engine: never resumed (no continue_generation), its version unchanged, nothing violated."""
    assert "/continue_generation" not in [e["path"] for e in calls(events)]
    assert "/update_weight_version" not in [e["path"] for e in calls(events)]
    state = engine.state()
    assert state["paused"] and state["weight_version"] == version
    assert [e["path"] for e in events if e["method"] == "LOOPBACK"] == []  # no violation


# -------------------------------------------------------------------------------------------------- tests


def test_lifecycle_order_on_three_engines_in_parallel(engines, mirror):
    """Each engine's state machine sees exactly pause -> release KV -> begin -> bump -> end -> resume KV -> flush ->
    continue, all successful; every rank's info is read before the push; the push lands inside the session and the
    flush after it; every step ran on all three engines before the next step started on any; the weights are
    bit-exact afterwards and no engine served a prefix cache from older weights."""
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
                pause, release, begin, bump, end, resume_kv, flush, cont = seq
                assert pause["body"] == {"mode": "abort"} and release["body"] == {"tags": ["kv_cache"]}
                assert bump["body"] == {"new_version": str(version), "abort_all_requests": False}
                assert begin["state"]["session_open"] and bump["state"]["session_open"]
                assert bump["state"]["weight_version"] == str(version)
                assert not end["state"]["session_open"] and not cont["state"]["paused"]
                assert resume_kv["state"]["released_tags"] == [] and release["state"]["released_tags"] == ["kv_cache"]
                # the one-sided writes happened inside the session, before the version moved; the flush after them
                assert begin["time"] <= mirror.started and mirror.finished <= bump["time"] <= flush["time"]
                # every rank's published info was read before the pause (connect, while the rollout still
                # generates) and re-read inside it (the recheck, overlapped with abort..begin), before the push
                reads = [e for e in events if e["path"] == RANK_READ]
                assert len(reads) == 2 * engine.spec.tp and all(e["time"] <= mirror.started for e in reads)
                # (the recheck starts with the abort, so one of its reads may reach the engine just before it)
                assert sum(e["time"] < pause["time"] for e in reads) >= engine.spec.tp
                assert [e["path"] for e in events if e["method"] == "GET" and e["path"] != RANK_READ] == (
                    ["/server_info"] if version == 1 else []
                )
                assert engine.violations(mark) == []
                steps.append(seq)
            for i in range(len(SYNC_SEQUENCE) - 1):  # lockstep: step i done everywhere before step i+1 anywhere
                assert max(s[i]["time"] for s in steps) <= min(s[i + 1]["time"] for s in steps), SYNC_SEQUENCE[i]
            assert mirror.mismatches(scale) == []
        assert versions(lifecycle) == ["2", "2", "2"]
    finally:
        lifecycle.close()


def test_keeping_the_kv_cache_the_flush_is_what_empties_the_prefix_cache(engines, mirror):
    """P2PCheckpointEngineManager's mode (frees_kv=False: no KV release, which would empty the cache): the sync
    flushes after the last write and before continue, and no engine serves a stale prefix. The same steps without
    the flush are caught: the loopback records `served_stale_prefix_cache` on every engine it resumes."""
    lifecycle = make_lifecycle(engines, frees_kv=False)
    scale = mirror.held_scale + 0.5
    try:
        since = marks(engines)
        asyncio.run(lifecycle.sync(8, mirror.push(scale)))
        for engine, mark in zip(engines, since, strict=True):
            seq = calls(engine.events(mark))
            assert [(e["method"], e["path"]) for e in seq] == KEEPS_KV
            flush = next(e for e in seq if e["path"] == "/flush_cache")
            assert mirror.finished <= flush["time"] <= seq[-1]["time"]
            assert engine.violations(mark) == []
        assert mirror.mismatches(scale) == []

        async def without_flush(adapters):  # negative control: the same steps by hand, minus the flush
            await asyncio.gather(*(a.pause() for a in adapters))
            await asyncio.gather(*(a.begin_session() for a in adapters))
            await mirror.push(scale + 0.25)(await lifecycle.connect())
            await asyncio.gather(*(a.bump_version("9") for a in adapters))
            await asyncio.gather(*(a.end_session() for a in adapters))
            await asyncio.gather(*(a.resume() for a in adapters))

        since = marks(engines)
        asyncio.run(without_flush(lifecycle.adapters))
        for engine, mark in zip(engines, since, strict=True):
            assert [v["path"] for v in engine.violations(mark)] == ["served_stale_prefix_cache"], engine.url
        asyncio.run(lifecycle.sync(10, mirror.push(scale)))  # back to a flushed cache everywhere
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
            assert paths[-4:] == [
                "/weights_checker",
                "/resume_memory_occupation",
                "/flush_cache",
                "/continue_generation",
            ]
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
    assert failed.value.stale_engines == [2]  # its bytes are wrong: never resumed
    assert "engine 0 (" not in text and "engine 1 (" not in text  # the others compared equal
    for engine, mark in zip(engines, since, strict=True):
        events = engine.events(mark)
        compare = [e for e in events if e["path"] == "/weights_checker"][-1]
        assert compare["status"] == (400 if engine is victim else 200)
        if engine is victim:
            assert engine.state()["paused"] and "/continue_generation" not in [e["path"] for e in events]
        else:
            assert not engine.state()["paused"] and events[-1]["path"] == "/continue_generation"
        assert engine.violations(mark) == []
    assert mirror.mismatches(scale) == [f"engine 2 rank 0: {name}"]
    victim.flip_byte(0, name, 7)  # flip it back
    assert mirror.mismatches(scale) == []


def test_frozen_rank_leaves_its_engine_paused_and_stale_until_the_next_sync(engines, mirror):
    """A rank frozen (SIGSTOP) mid-push: the push fails p2p_transfer_timeout after the freeze naming that engine,
    rank and session; its rank info is re-read and it is re-pushed once (p2p_push_retries=1), which times out too.
    The other engines are versioned, flushed and resumed, with every byte; the frozen one stays paused, its version
    unchanged, named stale, never resumed (the loopback, like SGLang, would have let it). Thawed, the next sync
    closes its left-open session, rewrites it exactly and only then resumes it."""
    lifecycle = make_lifecycle(engines, bootstrap=True)
    victim, scale = engines[1], mirror.held_scale + 0.25
    session = asyncio.run(lifecycle.adapters[1].rank_infos())[0].session_id
    frozen_at = []

    def freeze(batch: int) -> None:
        if batch == 0 and not frozen_at:
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
    print(f"frozen: sync raised {raised_at - frozen_at[0]:.2f} s after the freeze\n{error}")
    assert [f.step for f in error.failures] == ["push", "push retry 1"]
    for failure in error.failures:
        assert f"engine 1 rank 0 (session {session}): write of" in str(failure)
        assert f"timed out after {TRANSFER_TIMEOUT_S:g} s" in str(failure)
        assert "engine 0 rank" not in str(failure) and "engine 2 rank" not in str(failure)
    assert error.stale_engines == [1] and "rank(s) [0] not fully written" in error.stale[0].reason
    assert mirror.pushed_targets == [TargetRank(1, 0)]  # the retry wrote only the failed target
    # its end cannot run (the rank does not answer: the loopback's rank timeout, 6 s; http_timeout otherwise); it
    # is never resumed, so nothing else fails
    assert [(f.step, f.engine) for f in error.cleanup] == [("end", 1)], error.cleanup
    # the rank stays frozen until after the sync raised (thawed above, in the finally): it did not wait for it
    for index in (0, 2):
        events = engines[index].events(since[index])
        assert_restored(engines[index], events, after=mirror.finished)
        assert events[-1]["state"]["weight_version"] == "5"
    assert_parked(victim, victim.events(since[1]), before[1])
    assert mirror.mismatches(scale, engines=[0, 2]) == []

    # thawed: the next sync ends the session left open, rewrites every byte and resumes it
    scale += 0.25
    since = marks(engines)
    report = asyncio.run(lifecycle.sync(6, mirror.push(scale)))
    assert report.recovered_engines == [1] and not report.reconnected and lifecycle.stale == {}
    assert mirror.mismatches(scale) == []
    assert versions(lifecycle) == ["6", "6", "6"]
    paths = [e["path"] for e in calls(victim.events(since[1]))]
    assert paths[:3] == ["/pause_generation", "/release_memory_occupation", "/end_weight_update"]
    assert paths[-1] == "/continue_generation" and victim.violations(since[1]) == []
    lifecycle.close()


def test_a_transient_freeze_is_repushed_within_the_same_sync(engines, mirror):
    """The rank thaws right after the first push failed: the re-push (p2p_push_retries=1) writes it, the sync
    succeeds on every engine, bit-exact, nothing stale."""
    lifecycle = make_lifecycle(engines, bootstrap=True)
    victim, scale = engines[2], mirror.held_scale + 0.25
    frozen = []

    def freeze(batch: int) -> None:
        if batch == 0 and not frozen:
            victim.freeze_rank(0)
            frozen.append(True)

    def thaw() -> None:
        if frozen:
            victim.thaw_rank(0)

    mirror.after_batch, mirror.after_write = freeze, thaw
    since = marks(engines)
    try:
        report = asyncio.run(lifecycle.sync(7, mirror.push(scale)))
    finally:
        mirror.after_batch = mirror.after_write = None
        victim.thaw_rank(0)
    assert report.retried_targets == [TargetRank(2, 0)] and "push_retry_1" in report.phases
    assert mirror.mismatches(scale) == [] and versions(lifecycle) == ["7", "7", "7"]
    for engine, mark in zip(engines, since, strict=True):
        assert [(e["method"], e["path"]) for e in calls(engine.events(mark))] == SYNC_SEQUENCE
        assert engine.violations(mark) == [] and not engine.state()["paused"]
    lifecycle.close()


def test_killed_rank_mid_push_leaves_its_engine_paused_and_versions_the_others(engines, mirror):
    """Destructive, keep last. Engine 0's rank 1 is SIGKILLed after the push's first batch: the sync raises naming
    engine 0 rank 1 and its session; the re-push cannot even re-read its rank info (the rank is gone). Engines 1
    and 2 got all their bytes and are versioned, flushed and resumed; engine 0 stays paused and stale."""
    lifecycle = make_lifecycle(engines, bootstrap=True)
    victim, scale = engines[0], mirror.held_scale + 0.25
    session = asyncio.run(lifecycle.adapters[0].rank_infos())[1].session_id

    def kill(batch: int) -> None:
        if batch == 0 and victim.ranks_alive()[1]:
            victim.kill_rank(1)

    before = versions(lifecycle)
    since = marks(engines)
    mirror.after_batch = kill
    try:
        with pytest.raises(SyncError) as failed:
            asyncio.run(lifecycle.sync(11, mirror.push(scale)))
    finally:
        mirror.after_batch = None
    error = failed.value
    print(f"killed:\n{error}")
    assert [(f.step, f.engine) for f in error.failures] == [("push", None), ("reconnect", 0)]
    assert "weight sync to version '11' failed at push" in str(error)
    assert f"engine 0 rank 1 (session {session})" in str(error.failures[0])
    assert "engine 0 rank 0" not in str(error.failures[0])  # its other rank, and the other engines, got all bytes
    assert "No transfer engine info for rank 1" in str(error.failures[1]) or "404" in str(error.failures[1])
    assert error.stale_engines == [0]
    # its end cannot run (rank 1 is gone): named while restoring; it is never resumed
    assert [(f.step, f.engine) for f in error.cleanup] == [("end", 0)], error.cleanup
    assert "rank 1 is dead" in str(error.cleanup[0])
    for index in (1, 2):
        assert_restored(engines[index], engines[index].events(since[index]), after=mirror.finished)
    assert_parked(victim, victim.events(since[0]), before[0])
    assert versions(lifecycle)[1:] == ["11", "11"]
    assert mirror.mismatches(scale, engines=[1, 2]) == []
    lifecycle.close()

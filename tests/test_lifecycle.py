"""SyncLifecycle over several FakeSGLang stand-ins (real HTTP on 127.0.0.1): order, failures, connect cache."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from support.fake_sglang import FakeSGLang

from verl_p2p.config import P2PConfig
from verl_p2p.errors import TransferError
from verl_p2p.planning.targets import TargetRank
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.lifecycle import Connection, SyncError, SyncLifecycle

FULL = [
    "pause_generation",
    "release_memory_occupation",
    "begin_weight_update",
    "push",
    "update_weight_version",
    "end_weight_update",
    "resume_memory_occupation",
    "flush_cache",
    "continue_generation",
]
RESTORE = ["end_weight_update", "resume_memory_occupation", "continue_generation"]
PARKED = ["end_weight_update", "resume_memory_occupation"]  # a stale replica: never continue_generation


def adapters_for(servers, start: int = 0, **config) -> list[P2PReplicaAdapter]:
    cfg = P2PConfig(**{"http_timeout": 5.0, **config})
    return [
        P2PReplicaAdapter(start + i, s.url, bootstrap_url=s.bootstrap_url, config=cfg) for i, s in enumerate(servers)
    ]


def writer(
    servers: dict[int, FakeSGLang],
    seen: list | None = None,
    fail_on: int | None = None,
    times: int | None = None,
    generic: bool = False,
    on_fail=None,
):
    """The push: write every engine of the connection (the stand-in checks it is paused and in a session).

    `fail_on`: that engine's writes fail in the first `times` pushes reaching it (None: every push). As the real
    Writer does, every other target is still written and the error names the targets left unknown, or, with
    `generic`, names none (then every target counts as unknown). `on_fail` runs when a push fails."""
    left = [times]

    async def push(connection: Connection):
        if seen is not None:
            seen.append(connection)
        failed = []
        for engine in connection.engines:
            if engine == fail_on and left[0] != 0:
                failed = [t for t in connection.targets if t.engine == engine]
                continue
            servers[engine].write()
        if failed:
            if left[0] is not None:
                left[0] -= 1
            if on_fail is not None:
                on_fail()
            text = f"write to engine {fail_on} failed: transfer returned -1"
            raise RuntimeError(text) if generic else TransferError(text, unknown_targets=failed)
        return {"bytes": 123}

    return push


def assert_restored(server: FakeSGLang):
    assert not (server.paused or server.kv_released or server.session_open), server.url
    assert server.violations == [], server.violations


def assert_parked(server: FakeSGLang, version: str):
    """A stale replica: paused (never resumed), session ended, KV back, its version unchanged."""
    assert server.paused and not server.kv_released and not server.session_open, server.url
    assert server.weight_version == version and server.violations == []


def test_order_three_replicas_in_parallel(fakes):
    servers = fakes(3, tp_size=2)
    for server in servers:
        server.delay("begin_weight_update", 0.3)
    lifecycle = SyncLifecycle(adapters_for(servers))
    report = asyncio.run(lifecycle.sync(5, writer(dict(enumerate(servers)))))
    for server in servers:
        assert server.lifecycle_calls() == FULL
        assert server.weight_version == "5"
        assert server.bodies["update_weight_version"] == [{"new_version": "5", "abort_all_requests": False}]
        assert server.bodies["pause_generation"] == [{"mode": "abort"}]
        assert server.bodies["release_memory_occupation"] == [{"tags": ["kv_cache"]}]
        assert_restored(server)
    assert 0.3 <= report.phases["begin"] < 0.75  # three 0.3 s begins overlapped
    assert report.metrics == {"bytes": 123} and report.reconnected and report.generation == 1
    assert report.phases["control_plane"] == pytest.approx(report.phases["total"] - report.phases["push"])


def test_stand_in_allows_what_sglang_allows_and_records_it(fakes):
    """SGLang's continue_generation checks nothing: the stand-in resumes too, and records each violation."""
    (server,) = fakes(1)
    adapter = adapters_for([server])[0]

    async def out_of_order():
        await adapter.pause()
        await adapter.release_kv()
        await adapter.begin_session()
        server.write()
        await adapter.resume()  # inside an open session, KV released, weights written since the last flush

    asyncio.run(out_of_order())
    assert not server.paused
    assert server.violations == [
        "resumed_with_kv_cache_released",
        "resumed_inside_weight_update_session",
        "served_stale_prefix_cache",
    ]


@pytest.mark.parametrize("frees_kv", [True, False])
def test_flush_after_the_last_write_and_before_resume(fakes, frees_kv):
    """Both KV modes flush the prefix cache after the push, the version and the end (post-load processing may
    change weights), and before generation resumes; without the KV release nothing else empties the cache."""
    servers = fakes(2)
    lifecycle = SyncLifecycle(adapters_for(servers), frees_kv=frees_kv)
    asyncio.run(lifecycle.sync(1, writer(dict(enumerate(servers)))))
    for server in servers:
        calls = server.lifecycle_calls()
        assert calls == [c for c in FULL if frees_kv or "memory_occupation" not in c]
        flush = calls.index("flush_cache")
        assert max(calls.index(c) for c in ("push", "update_weight_version", "end_weight_update")) < flush
        assert flush == calls.index("continue_generation") - 1
        assert_restored(server)  # no "served_stale_prefix_cache"


def test_flush_is_retried_while_busy_and_a_replica_never_flushed_stays_paused(fakes):
    """SGLang answers /flush_cache with 400 while requests still run or wait: retried within http_timeout. A
    replica whose cache never flushes has new weights but a stale cache: it stays paused, named, until the next
    sync flushes it."""
    servers = fakes(2)
    busy = b"Cache not flushed because there are pending requests. #queue-req: 0, #running-req: 1"
    servers[0].fail("flush_cache", 400, busy, times=3)
    lifecycle = SyncLifecycle(adapters_for(servers, http_timeout=2.0), frees_kv=False)
    push = writer(dict(enumerate(servers)))
    asyncio.run(lifecycle.sync(1, push))
    assert servers[0].calls.count("flush_cache") == 4 and servers[1].calls.count("flush_cache") == 1
    assert_restored(servers[0])

    servers[1].fail("flush_cache", 400, busy)  # never succeeds
    before = servers[1].calls.count("flush_cache")
    start = time.monotonic()
    with pytest.raises(SyncError) as info:  # a retry without end would hang here
        asyncio.run(lifecycle.sync(2, push))
    assert time.monotonic() - start >= 1.0  # retried until http_timeout (2 s) would have passed, not given up early
    assert servers[1].calls.count("flush_cache") - before > 1
    error = info.value
    print(error)
    assert [(f.step, f.engine) for f in error.failures] == [("flush_cache", 1)]
    assert "cache still not flushed after" in str(error) and "pending requests" in str(error)
    assert "pause_mode=abort" in str(error)  # the hint: retracted requests block the flush on SGLang < 0.5.23
    assert error.stale_engines == [1] and "flush_cache failed" in error.stale[0].reason
    assert servers[1].paused and servers[1].weight_version == "2" and servers[1].violations == []
    assert_restored(servers[0])

    del servers[1].injected["flush_cache"]
    report = asyncio.run(lifecycle.sync(3, push))
    assert report.recovered_engines == [1] and lifecycle.stale == {}
    assert_restored(servers[1])


def test_retract_mode_and_no_kv_release(fakes):
    servers = fakes(2)
    lifecycle = SyncLifecycle(adapters_for(servers, pause_mode="retract"), frees_kv=False)
    asyncio.run(lifecycle.sync(1, writer(dict(enumerate(servers)))))
    for server in servers:
        assert server.lifecycle_calls() == [c for c in FULL if "memory_occupation" not in c]
        assert server.bodies["pause_generation"] == [{"mode": "retract"}]


def test_begin_failure_ends_other_sessions_and_resumes_everything(fakes):
    servers = fakes(3)
    servers[1].fail("begin_weight_update", 400, {"success": False, "message": "restore_weights_before_loading failed"})
    lifecycle = SyncLifecycle(adapters_for(servers))
    with pytest.raises(SyncError) as info:
        asyncio.run(lifecycle.sync(2, writer(dict(enumerate(servers)))))
    text = str(info.value)
    assert text.startswith("weight sync to version '2' failed at begin: begin on engine 1 (" + servers[1].url)
    assert "HTTP 400: restore_weights_before_loading failed" in text
    assert [(f.step, f.engine) for f in info.value.failures] == [("begin", 1)]
    assert info.value.cleanup == []  # end on engine 1 answering "no session" is expected, not a failure
    for server in servers:
        assert server.lifecycle_calls() == FULL[:3] + RESTORE
        assert server.weight_version == "default" and server.pushes == 0
        assert_restored(server)


def test_push_failure_leaves_only_the_unknown_replica_paused_until_rewritten(fakes):
    """Engine 2's writes fail (the others got every byte): its rank info is re-read and it alone is re-pushed
    (p2p_push_retries=1), which fails too. Engines 0 and 1 are versioned, flushed and resumed; engine 2 stays
    paused, its version unchanged, named stale in the error. The next sync rewrites it and only then resumes it."""
    servers = fakes(3, tp_size=2)
    by_engine = dict(enumerate(servers))
    lifecycle = SyncLifecycle(adapters_for(servers))
    seen: list[Connection] = []
    with pytest.raises(SyncError) as info:
        asyncio.run(lifecycle.sync(3, writer(by_engine, seen, fail_on=2)))
    error = info.value
    print(error)
    assert [(f.step, f.engine) for f in error.failures] == [("push", None), ("push retry 1", None)]
    assert str(error).startswith("weight sync to version '3' failed at push: write to engine 2 failed")
    assert f"stale replicas, paused until a sync rewrites them: engine 2 ({servers[2].url})" in str(error)
    assert error.stale_engines == [2]
    assert error.stale[0].reason == "rank(s) [0, 1] not fully written (push and 1 re-push(es) failed)"
    assert error.cleanup == []
    full, retry = seen
    assert not full.partial and retry.partial and retry.generation > full.generation
    assert retry.targets == [TargetRank(2, 0), TargetRank(2, 1)] and retry.engines == [2]
    # read before the pause and rechecked inside it (2 ranks each); the retry re-read engine 2's, and only its
    assert [s.bootstrap_calls.count("get_transfer_engine_info") for s in servers] == [4, 4, 6]
    for server in servers[:2]:
        assert server.lifecycle_calls() == FULL and server.weight_version == "3"
        assert_restored(server)
    assert servers[2].lifecycle_calls() == FULL[:3] + PARKED
    assert_parked(servers[2], "default")
    assert list(lifecycle.stale) == [2]

    report = asyncio.run(lifecycle.sync(4, writer(by_engine, seen)))
    assert report.recovered_engines == [2] and lifecycle.stale == {} and report.retried_targets == []
    assert not seen[-1].partial and len(seen[-1].targets) == 6
    for server in servers:
        assert server.lifecycle_calls()[-len(FULL) :] == FULL and server.weight_version == "4"
        assert_restored(server)


def test_transient_push_failure_is_repushed_in_the_same_sync_with_fresh_rank_info(fakes):
    """The first push fails on engine 1, whose server meanwhile restarted at the same address (new sessions,
    generating, no session open): the re-push reads its new rank info and, exactly like the normal path, aborts
    it, releases its KV and begins a session before writing it (review defect 7: before, it was written while
    serving); the sync succeeds and the next one keeps the new info."""
    servers = fakes(2, tp_size=2)
    by_engine = dict(enumerate(servers))
    lifecycle = SyncLifecycle(adapters_for(servers))
    seen: list[Connection] = []

    def restart() -> None:
        servers[1].restart({0: "127.0.0.1:19000", 1: "127.0.0.1:19001"})

    report = asyncio.run(lifecycle.sync(1, writer(by_engine, seen, fail_on=1, times=1, on_fail=restart)))
    assert report.retried_targets == [TargetRank(1, 0), TargetRank(1, 1)] and "push_retry_1" in report.phases
    assert seen[1].partial and seen[1].rank_infos[TargetRank(1, 0)].session_id == "127.0.0.1:19000"
    assert servers[0].lifecycle_calls() == FULL
    # the old server's session died with it: the end before the new begin is refused ("no session is open")
    assert servers[1].lifecycle_calls() == FULL[:3] + FULL[:2] + ["end_weight_update"] + FULL[2:]
    for server in servers:
        assert server.weight_version == "1"
        assert_restored(server)

    report = asyncio.run(lifecycle.sync(2, writer(by_engine, seen)))
    assert not report.reconnected and not seen[-1].partial and len(seen[-1].targets) == 4
    assert seen[-1].rank_infos[TargetRank(1, 0)].session_id == "127.0.0.1:19000"


def test_a_restarted_server_that_cannot_be_paused_is_left_out_of_the_repush(fakes):
    """Review defect 7, the other branch: the restarted engine refuses the abort before the re-push; it is
    never written while serving, stays stale and is named; the other engine is resumed."""
    servers = fakes(2, tp_size=1)
    by_engine = dict(enumerate(servers))
    lifecycle = SyncLifecycle(adapters_for(servers))

    def restart() -> None:
        servers[1].restart({0: "127.0.0.1:19000"})
        servers[1].fail("pause_generation", 500, {"error": {"message": "still loading"}}, times=1)

    with pytest.raises(SyncError) as info:
        asyncio.run(lifecycle.sync(1, writer(by_engine, fail_on=1, times=1, on_fail=restart)))
    assert info.value.stale_engines == [1] and servers[1].pushes == 0
    assert "abort (restarted, before re-push 1) on engine 1" in str(info.value) and "still loading" in str(info.value)
    assert "its server restarted during the sync and abort failed" in info.value.stale[0].reason
    assert servers[0].weight_version == "1"
    assert_restored(servers[0])


def test_a_push_error_naming_no_target_leaves_every_replica_paused(fakes):
    """An error that does not say which targets it left unknown (an export failure, say): every replica's
    bytes are unknown, so none is resumed; p2p_push_retries=0 pushes once."""
    servers = fakes(2)
    lifecycle = SyncLifecycle(adapters_for(servers), P2PConfig(p2p_push_retries=0))
    with pytest.raises(SyncError) as info:
        asyncio.run(lifecycle.sync(1, writer(dict(enumerate(servers)), fail_on=1, generic=True)))
    assert [(f.step, f.engine) for f in info.value.failures] == [("push", None)]
    assert info.value.stale_engines == [0, 1]
    assert servers[0].lifecycle_calls() == FULL[:4] + PARKED  # it was written, then the push failed
    assert servers[1].lifecycle_calls() == FULL[:3] + PARKED
    for server in servers:
        assert_parked(server, "default")


def test_after_a_failure_a_hanging_replica_does_not_hold_back_the_others(fakes):
    """Once the push failed on engine 2 it is parked on its own: its end hangs past http_timeout (as on a frozen
    rank) while engines 0 and 1 are versioned, flushed and generating again long before it gives up."""
    servers = fakes(3)
    servers[2].delay("end_weight_update", 3.0)
    lifecycle = SyncLifecycle(adapters_for(servers, http_timeout=1.0), P2PConfig(p2p_push_retries=0))
    failed_at, resumed_at = [], {}

    def watch():
        while len(resumed_at) < 2 and time.monotonic() < deadline:
            for i in (0, 1):
                if failed_at and i not in resumed_at and not servers[i].paused:
                    resumed_at[i] = time.monotonic()
            time.sleep(0.005)

    deadline = time.monotonic() + 10
    watcher = threading.Thread(target=watch)
    watcher.start()
    push = writer(dict(enumerate(servers)), fail_on=2, on_fail=lambda: failed_at.append(time.monotonic()))
    with pytest.raises(SyncError) as info:
        asyncio.run(lifecycle.sync(1, push))
    watcher.join()
    assert [(f.step, f.engine) for f in info.value.cleanup] == [("end", 2)]  # never resumed: stale
    assert "no answer within 1 s" in str(info.value.cleanup[0]) and info.value.stale_engines == [2]
    assert sorted(resumed_at) == [0, 1] and max(resumed_at.values()) - failed_at[0] < 0.5, resumed_at
    for server in servers[:2]:
        assert server.lifecycle_calls() == FULL and server.weight_version == "1"
        assert_restored(server)
    assert servers[2].paused and servers[2].weight_version == "default" and servers[2].violations == []


def test_abort_failure_touches_nothing_else(fakes):
    servers = fakes(2)
    servers[0].fail("pause_generation", 500, b"scheduler is gone")
    lifecycle = SyncLifecycle(adapters_for(servers))
    with pytest.raises(SyncError, match=r"abort on engine 0 \(.*\): .*HTTP 500: scheduler is gone"):
        asyncio.run(lifecycle.sync(1, writer(dict(enumerate(servers)))))
    for server in servers:
        assert server.lifecycle_calls() == ["pause_generation", "continue_generation"]
        assert_restored(server)


def test_bump_and_end_failures_leave_that_replica_paused(fakes):
    """A step after the push that fails on one replica (bump: its version would not name its weights; end:
    post-load processing may not have run) leaves that replica stale and paused; the others resume. The next
    sync rewrites it and resumes it."""
    servers = fakes(2)
    servers[1].fail("update_weight_version", 400, {"success": False, "message": "version rejected"}, times=1)
    lifecycle = SyncLifecycle(adapters_for(servers))
    push = writer(dict(enumerate(servers)))
    with pytest.raises(SyncError, match="failed at bump_version: bump_version on engine 1 .*version rejected") as info:
        asyncio.run(lifecycle.sync(1, push))
    assert info.value.stale_engines == [1] and info.value.stale[0].reason.startswith("bump_version failed")
    assert servers[0].lifecycle_calls() == FULL and servers[0].weight_version == "1"
    assert_restored(servers[0])
    assert servers[1].lifecycle_calls() == FULL[:5] + PARKED
    assert_parked(servers[1], "default")

    servers[0].fail("end_weight_update", 400, {"success": False, "message": "post_load_weights failed"}, times=1)
    with pytest.raises(SyncError) as info:
        asyncio.run(lifecycle.sync(2, push))
    assert "failed at end: end on engine 0" in str(info.value) and "post_load_weights failed" in str(info.value)
    assert info.value.stale_engines == [0] and info.value.cleanup == []  # parking ended its session on retry
    assert_parked(servers[0], "2")  # bumped before the end failed; still paused
    assert servers[1].weight_version == "2"
    assert_restored(servers[1])  # rewritten and resumed
    assert list(lifecycle.stale) == [0]


def test_old_servers_without_sessions(fakes):
    servers = fakes(2, sessions=False, version="0.5.12")
    lifecycle = SyncLifecycle(adapters_for(servers))
    push = writer(dict(enumerate(servers)))
    report = asyncio.run(lifecycle.sync(1, push))
    asyncio.run(lifecycle.sync(2, push))
    assert report.engines_without_sessions == [0, 1]
    for server in servers:
        assert server.calls.count("begin_weight_update") == 1  # asked once, then known
        assert "end_weight_update" not in server.calls
        assert server.weight_version == "2"


def test_connect_cached_and_redone_only_on_change(fakes):
    servers = fakes(2, tp_size=2)
    by_engine = dict(enumerate(servers))
    seen: list[Connection] = []
    lifecycle = SyncLifecycle(adapters_for(servers))
    reports = [asyncio.run(lifecycle.sync(v, writer(by_engine, seen))) for v in range(3)]
    assert [r.reconnected for r in reports] == [True, False, False]
    assert seen[0] is seen[1] is seen[2] and seen[0].generation == 1
    assert seen[0].targets == [TargetRank(e, r) for e in (0, 1) for r in (0, 1)]
    assert seen[0].layouts[TargetRank(1, 1)].tp_rank == 1 and seen[0].layouts[TargetRank(1, 1)].tp_size == 2
    for server in servers:
        assert server.calls.count("server_info") == 1
        # the per-sync read before the pause and its recheck inside it
        assert server.bootstrap_calls.count("get_transfer_engine_info") == 3 * 2 * 2

    servers[1].set_session_id(0, "127.0.0.1:19000")  # engine 1 rank 0 restarted its transfer engine
    report = asyncio.run(lifecycle.sync(3, writer(by_engine, seen)))
    assert report.reconnected and seen[-1].generation == 2 and seen[-1].changed_engines == {1}
    assert seen[-1].rank_infos[TargetRank(1, 0)].session_id == "127.0.0.1:19000"
    assert seen[-1].rank_infos[TargetRank(0, 0)] is seen[0].rank_infos[TargetRank(0, 0)]
    assert [s.calls.count("server_info") for s in servers] == [1, 2]

    (added,) = fakes(1, tp_size=1)
    by_engine[2] = added
    lifecycle.add_adapters(adapters_for([added], start=2))
    report = asyncio.run(lifecycle.sync(4, writer(by_engine, seen)))
    assert report.reconnected and seen[-1].changed_engines == {2} and seen[-1].generation == 3
    assert TargetRank(2, 0) in seen[-1].rank_infos and added.lifecycle_calls() == FULL
    assert [s.calls.count("server_info") for s in servers + [added]] == [1, 2, 1]

    lifecycle.remove_adapters([0])
    report = asyncio.run(lifecycle.sync(5, writer(by_engine, seen)))
    assert report.reconnected and seen[-1].removed_engines == {0} and seen[-1].engines == [1, 2]
    assert servers[0].weight_version == "4" and added.weight_version == "5"
    report = asyncio.run(lifecycle.sync(6, writer(by_engine, seen)))
    assert not report.reconnected and seen[-1] is seen[-2]


def test_replaced_replica_is_refetched(fakes):
    old, new = fakes(2)
    lifecycle = SyncLifecycle(adapters_for([old]))
    asyncio.run(lifecycle.sync(1, writer({0: old})))
    lifecycle.add_adapters(adapters_for([new]))  # same engine index 0, a new server
    seen: list[Connection] = []
    report = asyncio.run(lifecycle.sync(2, writer({0: new}, seen)))
    assert report.reconnected and seen[-1].changed_engines == {0} and new.calls.count("server_info") == 1


def test_connect_failure_means_no_push_and_no_bump(fakes):
    servers = fakes(2, tp_size=2)
    lifecycle = SyncLifecycle(adapters_for(servers))
    del servers[1].rank_info[1]  # rank 1 of engine 1 never registered
    with pytest.raises(SyncError) as info:
        asyncio.run(lifecycle.sync(1, writer(dict(enumerate(servers)))))
    assert [(f.step, f.engine) for f in info.value.failures] == [("connect", 1)]
    assert "No transfer engine info for rank 1" in str(info.value)
    for server in servers:
        assert server.lifecycle_calls() == []  # connect runs before the pause: the rollout never noticed
        assert server.weight_version == "default"


def test_unsupported_layout_named_at_connect(fakes):
    servers = fakes(1) + fakes(1, server_args={"enable_eplb": True})
    lifecycle = SyncLifecycle(adapters_for(servers))
    with pytest.raises(SyncError, match=r"connect on engine 1 \(.*\): .*enable_eplb"):
        asyncio.run(lifecycle.sync(1, writer(dict(enumerate(servers)))))
    assert all(s.pushes == 0 and not s.session_open for s in servers)


def test_overlapping_syncs_are_refused(fakes):
    (server,) = fakes(1)
    server.delay("pause_generation", 0.3)
    lifecycle = SyncLifecycle(adapters_for([server]))

    async def main():
        first = asyncio.create_task(lifecycle.sync(1, writer({0: server})))
        while "pause_generation" not in server.calls:  # the first sync is inside its (delayed) pause
            await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError, match="already running"):
            await lifecycle.sync(2, writer({0: server}))
        assert not first.done()  # refused while the first still ran, not queued behind it
        await first

    asyncio.run(main())
    assert server.weight_version == "1" and server.calls.count("pause_generation") == 1


def test_stale_open_session_is_closed_and_the_next_sync_works(fakes):
    servers = fakes(2)
    servers[1].session_open = True  # left open by an earlier sync whose end never arrived
    lifecycle = SyncLifecycle(adapters_for(servers))
    push = writer(dict(enumerate(servers)))
    with pytest.raises(SyncError, match="begin on engine 1 .*already open"):
        asyncio.run(lifecycle.sync(1, push))
    assert not servers[1].session_open  # the end sent after the failed begin closed it
    asyncio.run(lifecycle.sync(2, push))
    assert [s.weight_version for s in servers] == ["2", "2"]


def test_connect_alone(fakes):
    servers = fakes(2, tp_size=2)
    lifecycle = SyncLifecycle(adapters_for(servers))
    first = asyncio.run(lifecycle.connect())
    assert first.generation == 1 and first.changed_engines == {0, 1} and len(first.targets) == 4
    assert asyncio.run(lifecycle.connect()) is first
    servers[0].fail("get_server_info", 500, b"x")  # not asked: the cache holds engine 0's server info
    del servers[0].rank_info[1]
    with pytest.raises(SyncError, match=r"^rollout failed at connect: connect on engine 0 .*rank 1"):
        asyncio.run(lifecycle.connect())
    assert all(s.lifecycle_calls() == [] for s in servers)  # connect alone changes no state


def test_a_sync_failing_after_the_checker_reset_the_weights_resumes_nothing(fakes):
    """check_weight_update_equal randomises every replica's weights (reset_tensors) before the first push: a sync
    that fails after that (a begin, here) leaves them all stale and paused; the next sync writes and compares."""
    servers = fakes(2)
    servers[1].fail("begin_weight_update", 400, {"success": False, "message": "busy"}, times=1)
    lifecycle = SyncLifecycle(adapters_for(servers), P2PConfig(check_weight_update_equal=True))
    push = writer(dict(enumerate(servers)))
    with pytest.raises(SyncError) as info:
        asyncio.run(lifecycle.sync(1, push))
    assert [(f.step, f.engine) for f in info.value.failures] == [("begin", 1)]
    assert info.value.stale_engines == [0, 1] and "reset_tensors" in info.value.stale[0].reason
    for server in servers:
        assert server.checker == "reset" and "continue_generation" not in server.lifecycle_calls()
        assert_parked(server, "default")
    report = asyncio.run(lifecycle.sync(2, push))
    assert report.recovered_engines == [0, 1] and "check_compare" in report.phases
    for server in servers:
        assert server.checker == "compared"
        assert_restored(server)

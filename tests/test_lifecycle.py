"""SyncLifecycle over several FakeSGLang stand-ins (real HTTP on 127.0.0.1): order, failures, connect cache."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from support.fake_sglang import FakeSGLang

from verl_p2p.config import P2PConfig
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
    "continue_generation",
]
RESTORE = ["end_weight_update", "resume_memory_occupation", "continue_generation"]


def adapters_for(servers, start: int = 0, **config) -> list[P2PReplicaAdapter]:
    cfg = P2PConfig(**{"http_timeout": 5.0, **config})
    return [
        P2PReplicaAdapter(start + i, s.url, bootstrap_url=s.bootstrap_url, config=cfg) for i, s in enumerate(servers)
    ]


def writer(servers: dict[int, FakeSGLang], seen: list | None = None, fail_on: int | None = None):
    """The push: write every engine of the connection (the stand-in checks it is paused and in a session)."""

    async def push(connection: Connection):
        if seen is not None:
            seen.append(connection)
        for engine in connection.engines:
            if engine == fail_on:
                raise RuntimeError(f"write to engine {engine} failed: transfer returned -1")
            servers[engine].write()
        return {"bytes": 123}

    return push


def assert_restored(server: FakeSGLang):
    assert not (server.paused or server.kv_released or server.session_open), server.url


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


def test_stand_in_refuses_out_of_order_calls(fakes):
    (server,) = fakes(1)
    adapter = adapters_for([server])[0]

    async def out_of_order():
        await adapter.pause()
        await adapter.begin_session()
        await adapter.resume()  # generation inside an open session

    with pytest.raises(Exception, match="out of order: continue_generation inside a weight-update session"):
        asyncio.run(out_of_order())


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


def test_push_failure_never_bumps_and_restores_everywhere(fakes):
    servers = fakes(3)
    lifecycle = SyncLifecycle(adapters_for(servers))
    with pytest.raises(SyncError) as info:
        asyncio.run(lifecycle.sync(3, writer(dict(enumerate(servers)), fail_on=2)))
    assert [(f.step, f.engine) for f in info.value.failures] == [("push", None)]
    assert "failed at push: write to engine 2 failed" in str(info.value)
    for i, server in enumerate(servers):
        assert "update_weight_version" not in server.calls
        assert server.lifecycle_calls() == FULL[:3] + (["push"] if i < 2 else []) + RESTORE
        assert_restored(server)


def test_after_a_failure_a_hanging_replica_does_not_hold_back_the_others(fakes):
    """Once the push failed, each replica is restored on its own: engine 2's end hangs past http_timeout (as
    on a frozen rank), engines 0 and 1 are already generating again long before it gives up."""
    servers = fakes(3)
    servers[2].delay("end_weight_update", 3.0)
    lifecycle = SyncLifecycle(adapters_for(servers, http_timeout=1.0))
    failed_at, resumed_at = [], {}

    async def push(connection):
        failed_at.append(time.monotonic())
        raise RuntimeError("write to engine 2 timed out")

    def watch():
        while len(resumed_at) < 2 and time.monotonic() < deadline:
            for i in (0, 1):
                if failed_at and i not in resumed_at and not servers[i].paused:
                    resumed_at[i] = time.monotonic()
            time.sleep(0.005)

    deadline = time.monotonic() + 10
    watcher = threading.Thread(target=watch)
    watcher.start()
    with pytest.raises(SyncError) as info:
        asyncio.run(lifecycle.sync(1, push))
    watcher.join()
    assert [(f.step, f.engine) for f in info.value.cleanup] == [("end", 2), ("resume", 2)]
    assert "no answer within 1 s" in str(info.value.cleanup[0])
    assert sorted(resumed_at) == [0, 1] and max(resumed_at.values()) - failed_at[0] < 0.5, resumed_at
    for server in servers[:2]:
        assert server.lifecycle_calls() == FULL[:3] + RESTORE
        assert_restored(server)


def test_abort_failure_touches_nothing_else(fakes):
    servers = fakes(2)
    servers[0].fail("pause_generation", 500, b"scheduler is gone")
    lifecycle = SyncLifecycle(adapters_for(servers))
    with pytest.raises(SyncError, match=r"abort on engine 0 \(.*\): .*HTTP 500: scheduler is gone"):
        asyncio.run(lifecycle.sync(1, writer(dict(enumerate(servers)))))
    for server in servers:
        assert server.lifecycle_calls() == ["pause_generation", "continue_generation"]
        assert_restored(server)


def test_bump_and_end_failures_are_reported_and_restore_runs(fakes):
    servers = fakes(2)
    servers[1].fail("update_weight_version", 400, {"success": False, "message": "version rejected"}, times=1)
    lifecycle = SyncLifecycle(adapters_for(servers))
    push = writer(dict(enumerate(servers)))
    with pytest.raises(SyncError, match="failed at bump_version: bump_version on engine 1 .*version rejected"):
        asyncio.run(lifecycle.sync(1, push))
    for server in servers:
        assert server.lifecycle_calls()[-3:] == RESTORE
        assert_restored(server)
    servers[0].fail("end_weight_update", 400, {"success": False, "message": "post_load_weights failed"}, times=1)
    with pytest.raises(SyncError) as info:
        asyncio.run(lifecycle.sync(2, push))
    assert "failed at end: end on engine 0" in str(info.value) and "post_load_weights failed" in str(info.value)
    # the injected failure left the stand-in's session open, so it refuses to resume: reported, not hidden
    assert [(f.step, f.engine) for f in info.value.cleanup] == [("resume", 0)]
    assert "while restoring: resume on engine 0" in str(info.value)
    assert all(s.weight_version == "2" for s in servers)
    assert_restored(servers[1])
    assert servers[0].lifecycle_calls()[-3:] == RESTORE and not servers[0].kv_released


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
        assert server.bootstrap_calls.count("get_transfer_engine_info") == 3 * 2  # the per-sync check

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
        assert server.lifecycle_calls() == FULL[:3] + RESTORE
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
        await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="already running"):
            await lifecycle.sync(2, writer({0: server}))
        await first

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < 2 and server.weight_version == "1"


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

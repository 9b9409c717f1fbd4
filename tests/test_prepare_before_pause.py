"""The pause holds only the writes and the control steps around them (issue 18): connect and prepare (plan, the
trainer's replicas, programs, slots, first-push check) run while the rollout still generates, on the first sync
and in steady state; a rank info changed only after the abort is re-planned inside the pause, with the reason.

One event log per test: the stand-in servers' calls (tests/support/fake_sglang.py, real HTTP) and the
lifecycle's prepare/push callbacks, in arrival order."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from support.fake_sglang import FakeSGLang

from verl_p2p.config import P2PConfig
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.lifecycle import Connection, SyncError, SyncLifecycle

READS = {"server_info", "get_server_info", "get_transfer_engine_info"}
IN_PAUSE = [
    "abort",
    "release_kv",
    "begin",
    "recheck",
    "push",
    "bump_version",
    "end",
    "resume_kv",
    "flush_cache",
    "resume",
]


def setup(fakes, n: int = 2, tp: int = 2, **config):
    servers = fakes(n, tp_size=tp)
    journal: list[str] = []
    for server in servers:
        server.journal = journal
    cfg = P2PConfig(http_timeout=5.0, **config)
    adapters = [P2PReplicaAdapter(i, s.url, bootstrap_url=s.bootstrap_url, config=cfg) for i, s in enumerate(servers)]
    return servers, journal, adapters, cfg


def callbacks(servers, journal: list[str], planned: list[Connection]):
    """prepare: 'plan' once per generation (what the manager's init_process_group round does); push: write."""

    async def prepare(connection: Connection) -> None:
        if planned and planned[-1].generation == connection.generation:
            return
        journal.append("plan")
        planned.append(connection)

    async def push(connection: Connection) -> dict:
        assert planned[-1] is connection, "pushed with a plan made for another connection"
        for engine in connection.engines:
            servers[engine].write()
        return {}

    return prepare, push


def pause_window(journal: list[str]) -> list[str]:
    """The calls from the first abort to the last resume (the rollout paused)."""
    start = journal.index("pause_generation")
    end = len(journal) - 1 - journal[::-1].index("continue_generation")
    return journal[start : end + 1]


def test_first_and_steady_syncs_hold_no_connect_or_plan_in_the_pause(fakes):
    servers, journal, adapters, cfg = setup(fakes)
    lifecycle = SyncLifecycle(adapters, cfg)
    planned: list[Connection] = []
    prepare, push = callbacks(servers, journal, planned)
    for version in (1, 2, 3):
        journal.clear()
        report = asyncio.run(lifecycle.sync(version, push, prepare=prepare))
        window = pause_window(journal)
        before = journal[: journal.index("pause_generation")]
        assert "plan" not in window and not {"server_info", "get_server_info"} & set(window), window
        # each rank's info read before the pause, and once more by the recheck overlapped with abort..begin
        assert journal.count("get_transfer_engine_info") == 2 * 4
        assert report.steps_in_pause == IN_PAUSE and report.replanned_in_pause is None
        assert before.count("get_transfer_engine_info") >= 4
        if version == 1:
            assert before.count("plan") == 1 and before.count("server_info") == 2
        else:
            assert "plan" not in before and "server_info" not in before
        assert {"connect", "prepare", "paused", "recheck"} <= set(report.phases)
        assert report.phases["paused"] < report.phases["total"]
        assert [s.weight_version for s in servers] == [str(version)] * 2
    assert len(planned) == 1


def test_rank_info_changed_after_the_abort_is_replanned_inside_the_pause(fakes, caplog):
    servers, journal, adapters, cfg = setup(fakes)
    lifecycle = SyncLifecycle(adapters, cfg)
    planned: list[Connection] = []
    prepare, push = callbacks(servers, journal, planned)
    asyncio.run(lifecycle.sync(1, push, prepare=prepare))

    restarted = [False]

    async def prepare_then_restart(connection: Connection) -> None:
        await prepare(connection)
        if not restarted[0]:  # engine 1 rank 0 restarts its transfer engine after the read before the pause
            restarted[0] = True
            servers[1].delay("get_transfer_engine_info", 0.2)
            threading.Timer(0.05, servers[1].set_session_id, (0, "127.0.0.1:19000")).start()

    journal.clear()
    with caplog.at_level(logging.WARNING, logger="verl_p2p.rollout.lifecycle"):
        report = asyncio.run(lifecycle.sync(2, push, prepare=prepare_then_restart))
    assert report.reconnected and report.replanned_in_pause is not None
    assert "engine(s) [1] changed" in report.replanned_in_pause
    assert any("re-planning inside the pause" in r.message for r in caplog.records)
    assert "replan_in_pause" in report.steps_in_pause and "replan_in_pause" in report.phases
    assert "plan" in pause_window(journal)  # the one case a plan runs inside the pause
    assert planned[-1].rank_infos[planned[-1].targets[2]].session_id == "127.0.0.1:19000"
    assert [s.weight_version for s in servers] == ["2", "2"]


def test_a_server_restarted_after_the_abort_reached_it_is_paused_and_begun_again_before_the_push(fakes):
    """The restart lands between begin and the recheck's read: the new server generates and has no session. It is
    aborted and begun again before the push writes it (the stand-in refuses a write while generating or outside a
    session), re-planned, versioned and resumed like the others; nothing is recorded as a violation."""
    servers, journal, adapters, cfg = setup(fakes)
    lifecycle = SyncLifecycle(adapters, cfg)
    planned: list[Connection] = []
    prepare, push = callbacks(servers, journal, planned)
    asyncio.run(lifecycle.sync(1, push, prepare=prepare))
    begun = threading.Event()
    original = servers[1]._r_begin_weight_update

    def begin_then_restart(method, query, body):
        answer = original(method, query, body)
        if not begun.is_set():  # the first begin of this sync reached the old server; right after, it restarts
            begun.set()
            threading.Timer(0.02, servers[1].restart, ({0: "127.0.0.1:19100", 1: "127.0.0.1:19101"},)).start()
        return answer

    servers[1]._r_begin_weight_update = begin_then_restart
    servers[1].delay("get_transfer_engine_info", 0.3)  # the recheck's read answers after the restart
    journal.clear()
    report = asyncio.run(lifecycle.sync(2, push, prepare=prepare))
    assert begun.is_set() and report.replanned_in_pause is not None
    assert [s.weight_version for s in servers] == ["2", "2"]
    assert all(not s.paused and not s.session_open and s.violations == [] for s in servers)
    assert {"abort (restarted, inside the pause)", "begin (restarted, inside the pause)"} <= set(report.steps_in_pause)
    assert planned[-1].rank_infos[planned[-1].targets[2]].session_id == "127.0.0.1:19100"


def test_a_failed_prepare_fails_the_sync_before_anything_is_paused(fakes):
    servers, journal, adapters, cfg = setup(fakes)
    lifecycle = SyncLifecycle(adapters, cfg)

    async def prepare(connection: Connection) -> None:
        raise RuntimeError("trainer rank 3 cannot build its replica")

    async def push(connection: Connection) -> dict:
        raise AssertionError("no push after a failed prepare")

    with pytest.raises(SyncError, match="failed at prepare: trainer rank 3 cannot build its replica"):
        asyncio.run(lifecycle.sync(1, push, prepare=prepare))
    assert all(s.lifecycle_calls() == [] for s in servers)  # never paused
    assert set(journal) <= READS


def test_a_plan_made_before_the_first_begin_expects_what_the_release_says_about_sessions(fakes):
    """Before any begin the plan takes an engine's weight-update sessions from its release (0.5.21 added them), so
    an old server's 404 to begin does not change the plan inside the pause; the answer overrides the guess."""
    old = FakeSGLang(version="0.5.12", sessions=False)
    new = fakes(1)[0]
    try:
        adapters = [P2PReplicaAdapter(i, s.url, bootstrap_url=s.bootstrap_url) for i, s in enumerate([old, new])]
        assert [a.sessions_expected for a in adapters] == [None, None]  # nothing known before server info
        asyncio.run(SyncLifecycle(adapters).connect())
        assert [a.sessions_expected for a in adapters] == [False, True]
        assert asyncio.run(adapters[0].begin_session()) is False  # the 404
        assert adapters[0].sessions_expected is False and adapters[0].sessions_supported is False
    finally:
        old.stop()


def test_a_restart_between_the_recheck_read_and_the_abort_is_replanned_in_the_pause(fakes):
    """Review finding 7: engine 1 restarts its transfer engine while this sync's abort is on its way (the rank info
    changes just before the abort is handled). The recheck's read must come after the abort was answered, so it
    sees the new session and the push writes it with a plan made for it (before the fix the read raced the
    abort, saw the old session, and the push used the old plan)."""
    servers, journal, adapters, cfg = setup(fakes)
    lifecycle = SyncLifecycle(adapters, cfg)
    planned: list[Connection] = []
    prepare, push = callbacks(servers, journal, planned)
    asyncio.run(lifecycle.sync(1, push, prepare=prepare))
    original = servers[1]._r_pause_generation

    def restart_then_abort(method, query, body):
        servers[1].rank_info[0][0] = "127.0.0.1:19200"  # the restart lands just before the abort is handled
        return original(method, query, body)

    servers[1]._r_pause_generation = restart_then_abort
    servers[1].delay("pause_generation", 0.3)  # the abort arrives late: a read racing it answers first
    journal.clear()
    report = asyncio.run(lifecycle.sync(2, push, prepare=prepare))
    assert report.replanned_in_pause is not None and "engine(s) [1] changed" in report.replanned_in_pause
    assert planned[-1].rank_infos[planned[-1].targets[2]].session_id == "127.0.0.1:19200"
    assert "abort (restarted, inside the pause)" in report.steps_in_pause
    assert [s.weight_version for s in servers] == ["2", "2"]

"""check_weight_update_equal through SyncLifecycle against FakeSGLang stand-ins (real HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from verl_p2p.config import P2PConfig
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.checker import WeightUpdateChecker, checker_fields
from verl_p2p.rollout.lifecycle import SyncError, SyncLifecycle


def lifecycle_for(servers, resumed: bool = False, **options) -> SyncLifecycle:
    config = P2PConfig(**{"http_timeout": 5.0, **options}, check_weight_update_equal=True)
    adapters = [
        P2PReplicaAdapter(i, s.url, bootstrap_url=s.bootstrap_url, config=config) for i, s in enumerate(servers)
    ]
    return SyncLifecycle(adapters, config, checker=WeightUpdateChecker(config, resumed_from_checkpoint=resumed))


def writer(servers, skip: int | None = None):
    async def push(connection):
        for engine in connection.engines:
            if engine != skip:
                servers[engine].write()
        return {}

    return push


def test_snapshot_reset_before_first_sync_compare_after(fakes):
    servers = fakes(2)
    lifecycle = lifecycle_for(servers)
    asyncio.run(lifecycle.sync(1, writer(servers)))
    asyncio.run(lifecycle.sync(2, writer(servers)))
    for server in servers:
        assert server.lifecycle_calls()[:10] == [
            "pause_generation",
            "release_memory_occupation",
            "weights_checker",
            "weights_checker",
            "begin_weight_update",
            "push",
            "update_weight_version",
            "end_weight_update",
            "weights_checker",
            "resume_memory_occupation",
        ]
        assert [b["action"] for b in server.bodies["weights_checker"]] == ["snapshot", "reset_tensors", "compare"]
        assert server.checker == "compared" and server.weight_version == "2"
    assert lifecycle.checker.state == "done"


def test_compare_failure_raises_naming_the_replica(fakes):
    servers = fakes(3)
    lifecycle = lifecycle_for(servers)
    with pytest.raises(SyncError) as info:
        asyncio.run(lifecycle.sync(1, writer(servers, skip=1)))  # the push misses engine 1
    text = str(info.value)
    assert f"compare failed on engine 1 ({servers[1].url})" in text
    assert "model.layers.0.mlp.weight: values differ from the snapshot" in text
    assert "engine 0 (" not in text and "engine 2 (" not in text
    assert info.value.stale_engines == [1]  # its bytes differ from the checkpoint: never resumed
    assert servers[1].paused and not (servers[1].kv_released or servers[1].session_open)
    for server in (servers[0], servers[2]):
        assert not (server.paused or server.kv_released or server.session_open)


def test_a_failed_compare_is_rearmed_and_compared_again_until_it_passes(fakes):
    """Review defect 8 (earlier review) and finding 8: the next sync rewrites the replica whose compare failed with
    the same (wrong) bytes; it must be checked again and stay stale, not resumed because the check already ran
    once; and checked against a snapshot of its own (re-armed: snapshot + reset), not the first one."""
    servers = fakes(2)
    servers[1].compare_error = "model.layers.0.mlp.weight: values differ from the snapshot"  # a wrong write
    lifecycle = lifecycle_for(servers)
    for version in (1, 2):
        with pytest.raises(SyncError, match="compare failed on engine 1") as info:
            asyncio.run(lifecycle.sync(version, writer(servers)))
        assert info.value.stale_engines == [1] and servers[1].paused  # before the fix: sync 2 resumed it
    armed_twice = ["snapshot", "reset_tensors", "compare", "snapshot", "reset_tensors", "compare"]
    assert [b["action"] for b in servers[1].bodies["weights_checker"]] == armed_twice
    assert [b["action"] for b in servers[0].bodies["weights_checker"]] == ["snapshot", "reset_tensors", "compare"]
    servers[1].compare_error = None  # the write is fixed
    report = asyncio.run(lifecycle.sync(3, writer(servers)))
    assert report.recovered_engines == [1] and not servers[1].paused
    assert lifecycle.checker.state == "done"
    asyncio.run(lifecycle.sync(4, writer(servers)))
    assert len(servers[1].bodies["weights_checker"]) == 9  # passed once: not checked again


def test_a_timed_out_compare_is_rearmed_by_the_next_sync(fakes):
    """Finding 8: a compare that passed on the server but answered after http_timeout. SGLang drops a rank's
    snapshot once its compare passed there, so comparing again against the first snapshot can never pass (a
    permanent stale trap before the fix); the next sync snapshots, resets and compares again, and resumes it."""
    servers = fakes(1)
    lifecycle = lifecycle_for(servers, http_timeout=2.0)

    async def slow_compare(connection):
        servers[0].write()
        servers[0].delay("weights_checker", 3.0)  # the compare after this push answers too late

    with pytest.raises(SyncError, match="compare failed on engine 0") as info:
        asyncio.run(lifecycle.sync(1, slow_compare))
    assert info.value.stale_engines == [0]
    servers[0].delays.clear()
    deadline = time.monotonic() + 10
    while servers[0].checker != "compared" and time.monotonic() < deadline:  # the server finishes it meanwhile
        time.sleep(0.05)
    report = asyncio.run(lifecycle.sync(2, writer(servers)))
    assert report.recovered_engines == [0] and not servers[0].paused
    actions = ["snapshot", "reset_tensors", "compare", "snapshot", "reset_tensors", "compare"]
    assert [b["action"] for b in servers[0].bodies["weights_checker"]] == actions
    assert lifecycle.checker.state == "done"


def test_a_rank_info_change_keeping_the_sessions_keeps_the_check(fakes):
    """Finding 8: an engine whose rank info changed inside the pause but whose transfer-engine sessions did not is
    the same server process (its weights were just reset by the checker): it is still compared. Before the fix
    any change forgot it, and the check of its random weights silently vanished."""
    servers = fakes(2)
    lifecycle = lifecycle_for(servers)

    async def move_a_parameter(connection):  # once, after the read before the pause: the recheck sees it
        if connection.generation > 1:
            return
        with servers[1].lock:
            servers[1].rank_info[0][1]["model.layers.0.mlp.weight"][0] += 1 << 20
            servers[1]._encoded.clear()

    report = asyncio.run(lifecycle.sync(1, writer(servers), prepare=move_a_parameter))
    assert report.replanned_in_pause is not None
    assert [b["action"] for b in servers[1].bodies["weights_checker"]] == ["snapshot", "reset_tensors", "compare"]
    assert lifecycle.checker.state == "done"


def test_a_server_restarted_in_the_pause_is_not_compared(fakes):
    """A new transfer-engine session inside the pause is a new server process that never saw the snapshot: it is
    not compared (its compare would fail on a missing snapshot); the others are."""
    servers = fakes(2)
    lifecycle = lifecycle_for(servers)

    async def restart(connection):  # once, after the read before the pause: the recheck sees it
        if servers[1].rank_info[0][0] != "127.0.0.1:19300":
            servers[1].restart({0: "127.0.0.1:19300"})

    report = asyncio.run(lifecycle.sync(1, writer(servers), prepare=restart))
    assert report.replanned_in_pause is not None
    assert [b["action"] for b in servers[1].bodies["weights_checker"]] == ["snapshot", "reset_tensors"]
    assert [b["action"] for b in servers[0].bodies["weights_checker"]] == ["snapshot", "reset_tensors", "compare"]
    assert lifecycle.checker.state == "done"


def test_server_message_of_a_mismatch_is_passed_on(fakes):
    servers = fakes(1)
    servers[0].compare_error = "lm_head.weight: max abs diff 0.5"
    with pytest.raises(SyncError, match=r"compare failed on engine 0 .*lm_head.weight: max abs diff 0.5"):
        asyncio.run(lifecycle_for(servers).sync(1, writer(servers)))


def test_push_failure_leaves_compare_pending(fakes):
    servers = fakes(1)
    lifecycle = lifecycle_for(servers)

    async def broken(connection):
        raise RuntimeError("transfer failed")

    with pytest.raises(SyncError, match="failed at push"):
        asyncio.run(lifecycle.sync(1, broken))
    assert lifecycle.checker.wants_compare
    asyncio.run(lifecycle.sync(2, writer(servers)))
    assert [b["action"] for b in servers[0].bodies["weights_checker"]] == ["snapshot", "reset_tensors", "compare"]


SKIP = {"skip_tensor_list": ["k_scale", "v_scale"]}


@pytest.mark.parametrize(
    "version, reset_fields, compare_fields, notes",
    [
        ("0.5.12", {}, {}, 2),
        ("0.5.15", {}, {"allow_quant_error": True}, 1),
        ("0.5.20", {}, {"allow_quant_error": True}, 1),
        ("0.5.21", SKIP, {"allow_quant_error": True, **SKIP}, 0),
        ("0.5.23.dev4+gabc", SKIP, {"allow_quant_error": True, **SKIP}, 0),
        ("0.0.0.dev0", {}, {}, 2),
    ],
)
def test_fields_gated_by_server_version(fakes, version, reset_fields, compare_fields, notes, caplog):
    servers = fakes(1, version=version)
    options = {"check_weight_update_allow_quant_error": True, "check_weight_update_skip_list": ("k_scale", "v_scale")}
    with caplog.at_level(logging.WARNING, logger="verl_p2p.rollout.checker"):
        asyncio.run(lifecycle_for(servers, **options).sync(1, writer(servers)))
    assert servers[0].bodies["weights_checker"] == [
        {"action": "snapshot"},
        {"action": "reset_tensors", **reset_fields},
        {"action": "compare", **compare_fields},
    ]
    dropped = [r.getMessage() for r in caplog.records if "not sent" in r.getMessage()]
    assert len(dropped) == notes and all(f"SGLang {version} predates" in d for d in dropped[:1])


def test_checker_fields_notes_what_was_dropped():
    config = P2PConfig(check_weight_update_allow_quant_error=True, check_weight_update_skip_list=("k_scale",))
    fields, dropped = checker_fields(config, "0.5.12", "compare")
    assert fields == {}
    assert dropped == [
        "allow_quant_error not sent: SGLang 0.5.12 predates it (needs >= 0.5.15)",
        "skip_tensor_list not sent: SGLang 0.5.12 predates it (needs >= 0.5.21)",
    ]
    _, dropped = checker_fields(config, "garbage", "compare")
    assert dropped[0].startswith("allow_quant_error not sent: SGLang of unknown version ('garbage')")
    assert checker_fields(config, "0.5.23", "snapshot") == ({}, [])  # snapshot copies every tensor
    assert checker_fields(config, "0.5.21", "reset_tensors") == ({"skip_tensor_list": ["k_scale"]}, [])
    assert checker_fields(P2PConfig(), "0.5.23", "compare") == ({}, [])


def test_dropped_skip_list_is_named_in_the_failure(fakes):
    servers = fakes(1, version="0.5.12")
    servers[0].compare_error = "k_scale differs"
    with pytest.raises(SyncError, match=r"k_scale differs \[skip_tensor_list not sent: SGLang 0.5.12 predates it"):
        asyncio.run(lifecycle_for(servers, check_weight_update_skip_list=("k_scale",)).sync(1, writer(servers)))


def test_skipped_when_resumed_from_checkpoint(fakes, caplog):
    servers = fakes(2)
    with caplog.at_level(logging.INFO, logger="verl_p2p.rollout.checker"):
        lifecycle = lifecycle_for(servers, resumed=True)
    asyncio.run(lifecycle.sync(1, writer(servers)))
    assert lifecycle.checker.state == "skipped"
    assert all("weights_checker" not in s.calls for s in servers)
    assert any("skipped: the trainer resumed from a checkpoint" in r.getMessage() for r in caplog.records)


def test_arm_failure_stops_the_sync_and_never_rearms(fakes):
    servers = fakes(2)
    servers[1].fail("weights_checker", 400, {"success": False, "message": "snapshot: out of host memory"}, times=1)
    lifecycle = lifecycle_for(servers)
    with pytest.raises(SyncError, match=r"check_arm: .*snapshot failed on engine 1 .*out of host memory") as info:
        asyncio.run(lifecycle.sync(1, writer(servers)))
    assert all(s.pushes == 0 and "begin_weight_update" not in s.calls for s in servers)
    assert info.value.stale_engines == [0, 1] and all(s.paused for s in servers)  # engine 0 was reset: random
    report = asyncio.run(lifecycle.sync(2, writer(servers)))  # no second snapshot of (possibly reset) weights
    assert report.recovered_engines == [0, 1] and not any(s.paused for s in servers)
    assert lifecycle.checker.state == "failed"
    assert [b["action"] for b in servers[0].bodies["weights_checker"]] == ["snapshot", "reset_tensors"]


def test_lifecycle_builds_the_checker_from_config(fakes):
    servers = fakes(1)
    config = P2PConfig(check_weight_update_equal=True)
    adapters = [P2PReplicaAdapter(0, servers[0].url, bootstrap_url=servers[0].bootstrap_url, config=config)]
    lifecycle = SyncLifecycle(adapters, config)
    asyncio.run(lifecycle.sync(1, writer(servers)))
    assert lifecycle.checker.state == "done" and servers[0].checker == "compared"
    assert SyncLifecycle(adapters, P2PConfig()).checker is None

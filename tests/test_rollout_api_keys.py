"""A rollout server started with API keys gets them on every control call (finding R19).

SGLang opens its ordinary routes (`/server_info`, `/model_info`, ...) with `api_key` only, and its admin routes
(pause, memory, weight version, sessions, rank info, weights checker, flush) with `admin_api_key` when the server
has one, else with `api_key` (`srt/utils/auth.py`). The stand-in server (tests/support/fake_sglang.py) answers
with SGLang's own decision function, per route level as the release's http_server.py declares it.
"""

from __future__ import annotations

import asyncio

import pytest
from support.fake_sglang import sglang_auth_levels

from verl_p2p.config import P2PConfig
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.client import RolloutCallError, SGLangClient

USER, ADMIN = "user-key", "admin-key"


def run(coro):
    return asyncio.run(coro)


class StandInReplica:
    """STAND-IN for a launched verl RolloutReplica: the attributes P2PReplicaAdapter reads (a real one needs Ray
    and GPUs)."""

    def __init__(self, server, sglang: dict):
        self.replica_rank = 0
        self.server_address = server.url.removeprefix("http://")
        self.config = type("RolloutConfigStandIn", (), {"engine_kwargs": {"sglang": sglang}})()


async def _sync_calls(adapter: P2PReplicaAdapter) -> None:
    """Every control call a sync makes, in its order."""
    await adapter.server_info(refresh=True)
    await adapter.rank_infos()
    await adapter.pause()
    await adapter.release_kv()
    await adapter.begin_session()
    await adapter.bump_version("7")
    await adapter.end_session()
    await adapter.resume_kv()
    await adapter.flush_cache()
    await adapter.resume()
    await adapter.client.weight_version()


@pytest.mark.parametrize("bootstrap", [True, False], ids=["bootstrap", "proxy-route"])
def test_a_server_with_both_keys_gets_each_on_its_routes(fakes, bootstrap):
    (server,) = fakes(1, tp_size=2, api_key=USER, admin_api_key=ADMIN, bootstrap=bootstrap)
    sglang = {"api_key": USER, "admin_api_key": ADMIN}
    if bootstrap:
        sglang["engine_info_bootstrap_port"] = int(server.bootstrap_url.rsplit(":", 1)[1])
    adapter = P2PReplicaAdapter.from_replica(StandInReplica(server, sglang))
    run(_sync_calls(adapter))
    assert server.weight_version == "7" and not server.paused
    assert {"server_info", "pause_generation", "end_weight_update", "flush_cache"} <= set(server.calls)
    # the server refuses each call without its key: the keys above are what let the sync through
    for key in (None, USER):
        with pytest.raises(RolloutCallError) as info:
            run(SGLangClient(server.url, api_key=key).pause_generation())
        assert info.value.status == 401 and "api_key" in info.value.hint
    with pytest.raises(RolloutCallError) as info:
        run(SGLangClient(server.url, admin_api_key=ADMIN).server_info())
    assert info.value.status == 401


def test_p2ps_api_key_option_is_the_admin_key(fakes):
    (server,) = fakes(1, api_key=USER, admin_api_key=ADMIN, bootstrap=False)
    adapter = P2PReplicaAdapter.from_replica(StandInReplica(server, {"api_key": USER}), P2PConfig(api_key=ADMIN))
    run(_sync_calls(adapter))
    assert server.weight_version == "7"


def test_the_engine_paths_leader_sends_the_keys_its_rollout_config_names(fakes):
    """The rollout leader (backend/engine.py) builds its adapter from verl's RolloutConfig, not a replica."""
    from verl.workers.config import RolloutConfig

    (server,) = fakes(1, api_key=USER, admin_api_key=ADMIN, bootstrap=False)
    config = RolloutConfig(name="sglang", engine_kwargs={"sglang": {"api_key": USER, "admin_api_key": ADMIN}})
    adapter = P2PReplicaAdapter.for_rollout(0, server.url, P2PConfig(), config)
    run(_sync_calls(adapter))
    assert server.weight_version == "7"


def test_the_bootstrap_server_is_sent_no_key(fakes):
    (server,) = fakes(1, api_key=USER, admin_api_key=ADMIN)
    port = int(server.bootstrap_url.rsplit(":", 1)[1])
    sglang = {"api_key": USER, "admin_api_key": ADMIN, "engine_info_bootstrap_port": port}
    run(P2PReplicaAdapter.from_replica(StandInReplica(server, sglang)).rank_infos())
    assert server.bootstrap_calls == ["get_transfer_engine_info"]
    assert "Authorization" not in server.headers[-1]


@pytest.mark.parametrize("version", ["0.5.12", "0.5.21", "0.5.23"])
def test_the_routes_taken_as_ordinary_are_the_ones_sglang_leaves_to_api_key(version):
    """Each route the client calls is ordinary in SGLang `version` exactly when the client sends it `api_key`."""
    from verl_p2p.rollout.client import NORMAL_ROUTES

    levels = sglang_auth_levels(version)
    called = [
        "/server_info", "/get_server_info", "/weight_version", "/get_weight_version", "/model_info", "/health",
        "/pause_generation", "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation",
        "/flush_cache", "/update_weight_version", "/weights_checker", "/begin_weight_update", "/end_weight_update",
        "/remote_instance_transfer_engine_info", "/get_remote_instance_transfer_engine_info",
    ]  # fmt: skip
    known = [route for route in called if route in levels]
    assert {"/server_info", "/pause_generation", "/weights_checker"} <= set(known)
    assert {r for r in known if levels[r] == "normal"} == {r for r in known if r in NORMAL_ROUTES}
    assert {levels[r] for r in known} <= {"normal", "admin_optional"}  # none needs the admin key alone

"""SGLangClient against real HTTP servers on 127.0.0.1 (the FakeSGLang stand-in; see tests/support)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from support.fake_sglang import FakeSGLang, free_port

from verl_p2p.errors import RolloutHTTPError
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.client import RolloutCallError, SGLangClient


@pytest.fixture
def fake():
    servers = []

    def make(**kwargs) -> FakeSGLang:
        servers.append(FakeSGLang(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def run(coro):
    return asyncio.run(coro)


def test_404_names_server_route_status_and_message(fake):
    server = fake()
    client = SGLangClient(server.url)
    with pytest.raises(RolloutCallError) as info:
        run(client.request("POST", "/no_such_route"))
    err = info.value
    assert isinstance(err, RolloutHTTPError)
    assert (err.server, err.route, err.status, err.message) == (server.url, "/no_such_route", 404, "Not Found")
    assert str(err) == f"{server.url} POST /no_such_route: HTTP 404: Not Found"


@pytest.mark.parametrize(
    "body, message",
    [
        ({"error": {"message": "invalid mode 'x'"}}, "invalid mode 'x'"),  # SGLang's _create_error_response
        ({"success": False, "message": "already open"}, "already open"),
        ({"detail": "Invalid rank parameter"}, "Invalid rank parameter"),  # FastAPI HTTPException
        ({"detail": [{"loc": ["body", "mode"], "msg": "field required"}]}, "field required"),  # validation
        ({"error": "Unauthorized"}, "Unauthorized"),
    ],
)
def test_400_json_body_message(fake, body, message):
    server = fake()
    server.fail("pause_generation", 400, body)
    with pytest.raises(RolloutCallError) as info:
        run(SGLangClient(server.url).pause_generation("abort"))
    assert info.value.status == 400
    assert info.value.message == message
    assert f"{server.url} POST /pause_generation: HTTP 400: {message}" in str(info.value)


def test_500_plain_text_body(fake):
    server = fake()
    server.fail("end_weight_update", 500, b"Internal Server Error: scheduler died")
    with pytest.raises(RolloutCallError) as info:
        run(SGLangClient(server.url).end_weight_update())
    assert info.value.status == 500
    assert info.value.message == "Internal Server Error: scheduler died"


def test_success_false_with_200_is_an_error(fake):
    server = fake()
    server.fail("update_weight_version", 200, {"success": False, "message": "Failed to update weight version"})
    with pytest.raises(RolloutCallError, match="Failed to update weight version"):
        run(SGLangClient(server.url).update_weight_version("3"))


def test_connection_refused_is_named_and_not_waited_out():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RolloutCallError) as info:  # a client waiting out its timeout would hang here for an hour
        run(SGLangClient(url, timeout=3600).server_info())
    assert info.value.status is None
    assert info.value.server == url and info.value.route == "/server_info"
    assert "connection refused" in str(info.value)


def test_slow_server_times_out_within_bound(fake):
    server = fake()
    server.delay("server_info", 3600)  # held until the fake stops: returning at all means the client gave up
    client = SGLangClient(server.url, timeout=0.3)
    with pytest.raises(RolloutCallError) as info:
        run(client.server_info())
    assert server.calls.count("server_info") == 1  # it was asked once and its answer never came
    assert info.value.status is None
    assert "no answer within 0.3 s" in str(info.value) and "http_timeout" in str(info.value)
    # a per-call timeout overrides the client's default
    server.delay("server_info", 0.4)
    assert run(client.server_info(timeout=3))["tp_size"] == 1


def test_blocking_io_stays_off_the_event_loop(fake):
    server = fake()
    server.delay("server_info", 0.4)
    client = SGLangClient(server.url)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        task = asyncio.create_task(ticker())
        await client.server_info()
        task.cancel()
        return ticks

    assert run(main()) >= 10  # the loop kept running while the call waited 0.4 s


def test_bearer_token_sent_and_401_hint(fake):
    server = fake(api_key="s3cret")
    with pytest.raises(RolloutCallError) as info:
        run(SGLangClient(server.url).pause_generation())
    assert info.value.status == 401 and "engine_kwargs.p2p.api_key" in str(info.value)
    run(SGLangClient(server.url, api_key="s3cret").pause_generation())
    assert server.headers[-1]["Authorization"] == "Bearer s3cret"
    assert server.paused


def test_old_route_names_fallback(fake):
    server = fake(old_routes_only=True, bootstrap=False, tp_size=2)
    client = SGLangClient(server.url)
    info = run(client.server_info())
    assert info["tp_size"] == 2 and info["version"] == "0.5.23"
    assert run(client.weight_version()) == "default"
    rank = run(client.get_rank_info(1))
    assert rank.session_id == "127.0.0.1:17001" and len(rank.params) == 4
    assert server.calls == [
        "server_info",
        "get_server_info",
        "weight_version",
        "get_weight_version",
        "remote_instance_transfer_engine_info",
        "get_remote_instance_transfer_engine_info",
    ]
    run(client.server_info())
    run(client.get_rank_info(0))
    assert server.calls[-2:] == ["get_server_info", "get_remote_instance_transfer_engine_info"]  # remembered


def test_weight_version_from_model_info_when_routes_are_gone(fake):
    server = fake()
    server.fail("weight_version", 404, {"detail": "deprecated: use /model_info"})  # SGLang 0.5.12
    server.fail("get_weight_version", 404, {"detail": "deprecated: use /model_info"})
    client = SGLangClient(server.url)
    run(client.pause_generation())
    run(client.begin_weight_update())
    run(client.update_weight_version("7"))
    assert run(client.weight_version()) == "7"
    assert server.bodies["update_weight_version"] == [{"new_version": "7", "abort_all_requests": False}]


def test_404_on_session_routes_means_old_sglang(fake, caplog):
    server = fake(sessions=False)
    client = SGLangClient(server.url)
    with caplog.at_level(logging.WARNING, logger="verl_p2p.rollout.client"):
        assert run(client.begin_weight_update()) is False
        assert run(client.end_weight_update()) is False
        assert run(client.begin_weight_update()) is False
    assert client.sessions_supported is False
    assert server.calls == ["begin_weight_update"]  # known afterwards: not asked again
    warnings = [r.getMessage() for r in caplog.records if "predates weight-update sessions" in r.getMessage()]
    assert len(warnings) == 1 and "post_load_weights" in warnings[0] and server.url in warnings[0]


def test_session_routes_supported(fake):
    server = fake()
    client = SGLangClient(server.url)
    run(client.pause_generation())
    assert run(client.begin_weight_update()) is True and server.session_open
    with pytest.raises(RolloutCallError, match="already open"):
        run(client.begin_weight_update())
    assert run(client.end_weight_update()) is True and not server.session_open
    assert client.sessions_supported is True


def test_rank_info_from_bootstrap_with_digest(fake):
    server = fake(tp_size=2)
    client = SGLangClient(server.url, bootstrap_url=server.bootstrap_url)
    assert run(client.bootstrap_health()) == "OK"
    first = run(client.rank_answer(1))
    assert first.info.session_id == "127.0.0.1:17001"
    param = first.info.params["model.layers.0.mlp.weight"]
    assert (param.numel, param.element_size) == (1024, 2)
    assert run(client.rank_answer(1, first)) is first  # unchanged body: the cached answer, unparsed
    server.set_session_id(1, "127.0.0.1:18001")
    second = run(client.rank_answer(1, first))
    assert second is not first and second.info.session_id == "127.0.0.1:18001"
    assert second.info.fingerprint() != first.info.fingerprint()
    assert server.bootstrap_calls == ["health"] + ["get_transfer_engine_info"] * 3
    assert server.calls == []
    with pytest.raises(RolloutCallError) as info:
        run(client.get_rank_info(5))
    assert info.value.server == server.bootstrap_url and info.value.status == 404
    assert "No transfer engine info for rank 5" in str(info.value) and "rank=5" in info.value.route


def test_unreachable_bootstrap_falls_back_to_control_plane(fake, caplog):
    server = fake(tp_size=2)
    client = SGLangClient(server.url, bootstrap_url=f"127.0.0.1:{free_port()}")
    with caplog.at_level(logging.WARNING, logger="verl_p2p.rollout.client"):
        assert run(client.get_rank_info(0)).session_id == "127.0.0.1:17000"
        assert run(client.get_rank_info(1)).session_id == "127.0.0.1:17001"
    assert server.calls == ["remote_instance_transfer_engine_info"] * 2
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1


def test_malformed_rank_info_is_named(fake):
    server = fake(bootstrap=False)
    server.fail("remote_instance_transfer_engine_info", 200, {"rank": 0, "oops": []})
    with pytest.raises(RolloutCallError) as info:
        run(SGLangClient(server.url).get_rank_info(0))
    assert "malformed transfer-engine info" in str(info.value) and server.url in str(info.value)


def test_weights_checker_sends_only_given_fields(fake):
    server = fake()
    client = SGLangClient(server.url)
    run(client.weights_checker("snapshot"))
    run(client.weights_checker("reset_tensors", skip_tensor_list=["k_scale"], selector="all"))
    assert server.bodies["weights_checker"] == [
        {"action": "snapshot"},
        {"action": "reset_tensors", "skip_tensor_list": ["k_scale"], "selector": "all"},
    ]
    with pytest.raises(RolloutCallError, match="values differ"):
        run(client.weights_checker("compare", allow_quant_error=True))


class StandInReplica:
    """STAND-IN for a launched verl RolloutReplica: the attributes P2PReplicaAdapter reads (a real one needs
    Ray and GPUs; verl's RolloutConfig keeps engine_kwargs as a plain dict, as here)."""

    def __init__(self, replica_rank: int, server_address: str, engine_kwargs: dict):
        self.replica_rank = replica_rank
        self.server_address = server_address
        self.config = type("RolloutConfigStandIn", (), {"engine_kwargs": engine_kwargs, "free_cache_engine": True})()


def test_adapter_from_replica_finds_bootstrap_and_key(fake):
    server = fake(tp_size=2, api_key="admin-key")
    host_port = server.url.removeprefix("http://")
    bootstrap_port = int(server.bootstrap_url.rsplit(":", 1)[1])
    sglang = {"engine_info_bootstrap_port": bootstrap_port, "admin_api_key": "admin-key", "host": "0.0.0.0"}
    adapter = P2PReplicaAdapter.from_replica(StandInReplica(3, host_port, {"sglang": sglang}))
    assert (adapter.engine, adapter.url, adapter.client.bootstrap_url) == (3, server.url, server.bootstrap_url)
    assert str(adapter) == f"engine 3 ({server.url})"
    infos = run(adapter.rank_infos())
    assert sorted(infos) == [0, 1] and infos[1].session_id == "127.0.0.1:17001"
    assert adapter.num_ranks == 2 and adapter.server_version == "0.5.23"
    assert [layout.tp_rank for layout in run(adapter.layouts()).values()] == [0, 1]
    assert server.calls == ["server_info"] and server.bootstrap_calls == ["get_transfer_engine_info"] * 2
    run(adapter.pause())
    assert server.headers[-1]["Authorization"] == "Bearer admin-key"


def test_adapter_from_replica_defaults(fake):
    server = fake()
    adapter = P2PReplicaAdapter.from_replica(StandInReplica(0, server.url.removeprefix("http://"), {}))
    assert adapter.client.bootstrap_url == "http://127.0.0.1:6789"  # SGLang's default port on node 0's host
    with pytest.raises(ValueError, match="no server address"):
        P2PReplicaAdapter.from_replica(StandInReplica(1, None, {}))
    with pytest.raises(RuntimeError, match="server info not fetched"):
        _ = adapter.num_ranks


def test_a_pooled_connection_the_server_closed_is_retried_once():
    # SGLang's uvicorn closes keep-alive connections idle for 5 s; a push takes longer. Here the server answers,
    # then closes each connection 0.1 s later, while the client's loop is busy (as during a blocking step), so
    # the next call goes out on a connection that is already closed: it must still be answered.
    served = []

    async def scenario():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            served.append(1)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n")
            writer.write(b'{"status":"ok"}')
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = SGLangClient(url, timeout=5)
        try:
            await client.continue_generation()
            await asyncio.sleep(0.02)  # the answer is read; the connection goes back to the pool
            time.sleep(0.3)  # the loop is blocked while the server closes the connection
            await client.continue_generation()
        finally:
            client.close()
            server.close()

    run(scenario())
    assert len(served) == 2

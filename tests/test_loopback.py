"""The loopback rollout engine: control plane, bootstrap, real rank processes with SGLang models and Mooncake."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
import torch

from verl_p2p.e2e.rollouts import checksums_of
from verl_p2p.loopback.checker import CheckFailed, Placement, WeightChecker
from verl_p2p.loopback.control import ControlContext, ThreadedServer, create_app
from verl_p2p.loopback.engine import EngineSpec, free_port, loopback_engines
from verl_p2p.loopback.features import Features, parse_version
from verl_p2p.loopback.lifecycle import Lifecycle, Refused
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.planning.targets import RemoteRankInfo
from verl_p2p.rollout.client import SGLangClient
from verl_p2p.sandbox.tiny import write_tiny_checkpoint

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
API_KEY = "loopback-test-key"
RANK_READ = "/remote_instance_transfer_engine_info"


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited child reparented to a PID 1 that does not reap stays a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------------------------------- no processes


def test_features_follow_the_reported_version():
    assert parse_version("0.5.22rc1") == (0, 5, 22) and parse_version("0.5.23.post1") == (0, 5, 23)
    old, new = Features.of("0.5.12"), Features.of("0.5.23")
    assert not old.weight_update_session and new.weight_update_session
    assert not old.checker_skip_tensor_list and new.checker_skip_tensor_list
    assert not old.weight_version_route and not new.weight_version_route and Features.of("0.5.5").weight_version_route
    # SGLang 0.5.21's io_struct.ChecksumInfo: parallelism_info became a list (target, then draft roles)
    assert not Features.of("0.5.20").checksum_roles_list and Features.of("0.5.21").checksum_roles_list
    with pytest.raises(ValueError):
        Features.of("latest")


def test_lifecycle_memory_tags():
    lc = Lifecycle()
    with pytest.raises(Refused, match="pause_generation first"):
        lc.release_memory(["kv_cache"])
    assert lc.pause("retract", dict) == []
    assert lc.release_memory(None) == ["kv_cache", "weights", "cuda_graph"]
    assert lc.resume_memory(["weights", "cuda_graph"]) == ["weights", "cuda_graph"]
    with pytest.raises(Refused, match="not released"):
        lc.resume_memory(["weights"])
    with pytest.raises(Refused, match="unknown memory tags"):
        lc.release_memory(["activations"])
    with pytest.raises(Refused, match="Invalid mode"):
        lc.pause("sleep", dict)


def test_weight_checker_on_a_plain_module():
    model = torch.nn.Linear(4, 3)
    model.rotary = torch.nn.Module()
    model.rotary.register_buffer("cos_sin_cache", torch.ones(2))
    model.register_buffer("scale", torch.full((2,), 3.0))
    checker = WeightChecker(model, Placement(0, 1))
    original = {k: v.clone() for k, v in model.state_dict().items()}
    checker.handle("snapshot")
    checker.handle("reset_tensors", skip_tensor_list=("scale",))
    assert torch.equal(model.scale, original["scale"]) and torch.equal(model.rotary.cos_sin_cache, torch.ones(2))
    with pytest.raises(CheckFailed) as failed:
        checker.handle("compare")
    assert (
        "name=weight " in str(failed.value) and "name=bias " in str(failed.value) and "scale" not in str(failed.value)
    )
    with torch.no_grad():
        model.weight.copy_(original["weight"])
        model.bias.copy_(original["bias"])
    checker.handle("compare")
    model.weight.data.view(-1).view(torch.uint8)[1] ^= 0x01  # one bit of one element
    with pytest.raises(CheckFailed, match="name=weight .*mismatched_bytes=1"):
        checker.handle("compare")
    checksum = checker.handle("checksum")
    assert set(checksum["checksums"]) == {"weight", "bias", "scale"}  # rotary cache is never checked


@pytest.fixture
def old_control_plane(tmp_path):
    """The control plane of an SGLang 0.5.12 engine with no ranks (routes and version gates only)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    ctx = ControlContext(
        lifecycle=Lifecycle(),
        features=Features.of("0.5.12"),
        server_args={"model_path": str(tmp_path), "api_key": None, "tp_size": 1},
        bootstrap_url=f"http://127.0.0.1:{free_port()}",  # nobody listens there
        ranks=[],
    )
    server = ThreadedServer(create_app(ctx), "127.0.0.1", free_port())
    server.start()
    yield f"http://127.0.0.1:{server.port}", ctx
    server.stop()


def test_old_release_lacks_sessions_and_weight_version_route(old_control_plane):
    url, ctx = old_control_plane
    assert requests.post(f"{url}/begin_weight_update", json={}).status_code == 404
    assert requests.post(f"{url}/end_weight_update", json={}).status_code == 404
    answer = requests.get(f"{url}/weight_version")
    assert answer.status_code == 404 and "/model_info" in answer.json()["message"]
    assert requests.post(f"{url}/update_weight_version", json={"new_version": "3"}).json()["new_version"] == "3"
    info = requests.get(f"{url}/model_info").json()
    assert info["weight_version"] == "3" and info["model_type"] == "qwen3"
    assert requests.get(f"{url}/get_server_info").json()["version"] == "0.5.12"
    assert requests.post(f"{url}/weights_checker").status_code == 400  # 0.5.12 requires a body with action
    assert requests.post(f"{url}/update_weight_version", json={}).status_code == 400  # new_version is required
    unreachable = requests.get(f"{url}/remote_instance_transfer_engine_info", params={"rank": 0})
    assert unreachable.status_code == 400 and "rank 0" in unreachable.json()["error"]["message"]
    assert requests.get(f"{url}/remote_instance_transfer_engine_info").status_code == 400
    events = [(e.path, e.status) for e in ctx.lifecycle.events()]
    assert events[:3] == [("/begin_weight_update", 404), ("/end_weight_update", 404), ("/weight_version", 404)]


# ------------------------------------------------------------------------------- one TP2/EP2 MoE engine


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("loopback") / "qwen3_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def engine(moe_checkpoint):
    spec = EngineSpec(tp=2, ep=2, api_key=API_KEY, sglang_version="0.5.23", rank_timeout_s=5)
    start = time.monotonic()
    with loopback_engines([spec], str(moe_checkpoint)) as (engine,):
        engine.start_seconds = time.monotonic() - start
        yield engine


@pytest.fixture(scope="module")
def http():
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {API_KEY}"
    yield session
    session.close()


@pytest.fixture(scope="module")
def mooncake():
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return te


def rank_info(engine, http, rank: int) -> RemoteRankInfo:
    answer = http.get(f"{engine.url}/remote_instance_transfer_engine_info", params={"rank": rank})
    assert answer.status_code == 200, answer.text
    return RemoteRankInfo.from_json(answer.json())


def write_params(te, info: RemoteRankInfo, tensors: dict[str, torch.Tensor]) -> None:
    """One-sided Mooncake writes of `tensors` into the rank, as a trainer does."""
    srcs = {name: t.contiguous().clone() for name, t in tensors.items()}
    for src in srcs.values():
        assert te.register_memory(src.data_ptr(), src.nbytes) == 0
    try:
        for name, src in srcs.items():
            assert info.params[name].nbytes == src.nbytes, name
        ret = te.batch_transfer_sync_write(
            info.session_id,
            [s.data_ptr() for s in srcs.values()],
            [info.params[n].address for n in srcs],
            [s.nbytes for s in srcs.values()],
        )
        assert ret == 0
    finally:
        for src in srcs.values():
            te.unregister_memory(src.data_ptr())


@pytest.mark.slow
def test_server_info_and_every_rank_publishes_every_parameter(engine, http):
    print(f"engine start-up: {engine.start_seconds:.1f} s")
    info = http.get(f"{engine.url}/server_info").json()
    assert info == {**http.get(f"{engine.url}/get_server_info").json(), "internal_states": info["internal_states"]}
    assert (info["tp_size"], info["ep_size"], info["dp_size"], info["version"]) == (2, 2, 1, "0.5.23")
    assert info["remote_instance_weight_loader_start_seed_via_transfer_engine"] is True
    assert info["enable_memory_saver"] is False and info["engine_info_bootstrap_port"] == engine.bootstrap_port
    sessions = set()
    for rank in range(2):
        assert layout_from_server_args(info, rank).moe_ep_rank == rank
        published = rank_info(engine, http, rank)
        old_name = http.get(f"{engine.url}/get_remote_instance_transfer_engine_info", params={"rank": rank})
        direct = requests.get(f"{engine.bootstrap_url}/get_transfer_engine_info", params={"rank": rank})
        assert RemoteRankInfo.from_json(old_name.json()) == published == RemoteRankInfo.from_json(direct.json())
        params = engine.dump(rank)
        assert set(published.params) == set(params) and len(params) > 20
        for name, tensor in params.items():
            p = published.params[name]
            assert (p.numel, p.element_size) == (tensor.numel(), tensor.element_size()), name
        assert len({p.address for p in published.params.values()}) == len(params)
        # SGLang's fused MoE layout: each EP rank holds 4 of the 8 experts, gate and up fused
        assert params["model.layers.0.mlp.experts.w13_weight"].shape == (4, 64, 64)
        assert "model.layers.0.self_attn.qkv_proj.weight" in params
        sessions.add(published.session_id)
    assert len(sessions) == 2
    assert not torch.equal(
        engine.dump(0)["model.layers.0.mlp.experts.w2_weight"], engine.dump(1)["model.layers.0.mlp.experts.w2_weight"]
    )
    assert requests.get(f"{engine.bootstrap_url}/health").text == "OK"
    assert requests.get(f"{engine.bootstrap_url}/get_transfer_engine_info", params={"rank": 2}).status_code == 404
    assert requests.get(f"{engine.bootstrap_url}/get_transfer_engine_info", params={"rank": -1}).status_code == 400
    bad = requests.put(f"{engine.bootstrap_url}/register_transfer_engine_info", json={"rank": 0})
    assert bad.status_code == 400
    assert http.get(f"{engine.url}/remote_instance_transfer_engine_info", params={"rank": -1}).status_code == 400


@pytest.mark.slow
def test_api_key_guards_everything_but_health(engine):
    assert requests.get(f"{engine.url}/health").status_code == 200
    assert requests.get(f"{engine.url}/server_info").status_code == 401
    assert requests.post(f"{engine.url}/pause_generation", json={}).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert requests.get(f"{engine.url}/remote_instance_transfer_engine_info?rank=0", headers=wrong).status_code == 401
    assert engine.events()[-1]["status"] == 401


@pytest.mark.slow
def test_mooncake_write_lands_in_the_rank(engine, http, mooncake):
    name = "model.layers.1.mlp.experts.w2_weight"
    before = {rank: engine.dump(rank)[name] for rank in range(2)}
    info = rank_info(engine, http, 1)
    new = -torch.arange(before[1].numel(), dtype=before[1].dtype).reshape(before[1].shape) - 0.5
    write_params(mooncake, info, {name: new})
    assert torch.equal(engine.dump(1)[name], new)
    assert torch.equal(engine.dump(0)[name], before[0])  # the other rank is untouched
    write_params(mooncake, info, {name: before[1]})
    assert torch.equal(engine.dump(1)[name], before[1])


@pytest.mark.slow
def test_lifecycle_refuses_what_sglang_refuses_and_records_what_it_allows(engine, http, mooncake):
    """Out-of-order calls SGLang refuses are refused; what SGLang allows is allowed and recorded as a violation:
    a session begun while generating; continue_generation inside an open session, with the KV cache released,
    with a prefix cache computed from weights written since its last flush (one-sided writes do not flush; a
    flush or a KV release does); and, seen at the next pause, a write that landed while generation ran."""
    since = len(engine.events())

    def post(path, body=None):
        return http.post(f"{engine.url}{path}", json=body or {})

    ended = post("/end_weight_update")
    assert ended.status_code == 400 and ended.json() == {
        "success": False,
        "message": "no weight-update session is open; call begin_weight_update() first",
    }
    assert post("/begin_weight_update", {"selector": "all"}).json()["success"] is True  # SGLang: no pause check
    assert post("/end_weight_update").json()["success"] is True
    assert post("/pause_generation", {"mode": "abort"}).json()["status"] == "ok"
    assert post("/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert post("/begin_weight_update", {"selector": "all"}).json()["success"] is True
    assert "already open" in post("/begin_weight_update", {"selector": "all"}).json()["message"]
    assert post("/continue_generation").status_code == 200  # session open, KV released: SGLang resumes anyway
    assert post("/pause_generation", {"mode": "abort"}).status_code == 200
    assert post("/update_weight_version", {"new_version": "7", "abort_all_requests": False}).json()["success"]
    assert post("/end_weight_update").json()["success"] is True
    assert post("/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert post("/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 400  # nothing released
    name = sorted(engine.dump(1))[0]
    original = engine.dump(1)[name]
    write_params(mooncake, rank_info(engine, http, 1), {name: original + 1})  # a one-sided write
    assert post("/continue_generation").status_code == 200  # no flush since: stale prefix cache served
    assert post("/pause_generation", {"mode": "abort"}).status_code == 200
    assert post("/flush_cache").status_code == 200
    assert post("/continue_generation").json()["status"] == "ok"  # flushed: nothing to record
    assert http.get(f"{engine.url}/model_info").json()["weight_version"] == "7"
    assert http.get(f"{engine.url}/weight_version").status_code == 404  # as SGLang >= 0.5.12: read /model_info
    write_params(mooncake, rank_info(engine, http, 1), {name: original})  # put it back, while generating
    assert post("/pause_generation", {"mode": "abort"}).status_code == 200
    assert post("/flush_cache").status_code == 200
    assert post("/continue_generation").status_code == 200

    events = engine.events(since)
    assert [(e["method"], e["path"], e["status"]) for e in events if e["path"] != RANK_READ] == [
        ("POST", "/end_weight_update", 400),
        ("POST", "/begin_weight_update", 200),
        ("LOOPBACK", "weight_update_began_while_generating", 200),
        ("POST", "/end_weight_update", 200),
        ("POST", "/pause_generation", 200),
        ("POST", "/release_memory_occupation", 200),
        ("POST", "/begin_weight_update", 200),
        ("POST", "/begin_weight_update", 400),
        ("POST", "/continue_generation", 200),
        ("LOOPBACK", "resumed_inside_weight_update_session", 200),
        ("LOOPBACK", "resumed_with_kv_cache_released", 200),
        ("POST", "/pause_generation", 200),
        ("POST", "/update_weight_version", 200),
        ("POST", "/end_weight_update", 200),
        ("POST", "/resume_memory_occupation", 200),
        ("POST", "/resume_memory_occupation", 400),
        ("POST", "/continue_generation", 200),
        ("LOOPBACK", "served_stale_prefix_cache", 200),
        ("POST", "/pause_generation", 200),
        ("POST", "/flush_cache", 200),
        ("POST", "/continue_generation", 200),
        ("GET", "/model_info", 200),
        ("GET", "/weight_version", 404),
        ("POST", "/pause_generation", 200),
        ("LOOPBACK", "weights_written_while_serving", 200),
        ("POST", "/flush_cache", 200),
        ("POST", "/continue_generation", 200),
    ]
    stale, written = engine.violations(since)[-2:]
    assert "rank(s) [1] changed since the cache was last flushed" in stale["message"]
    assert "rank(s) [1] changed while generation ran" in written["message"]
    assert events[6]["state"]["session_open"] and events[12]["state"]["weight_version"] == "7"
    over_http = http.get(f"{engine.url}/loopback/events", params={"since": since}).json()["events"]
    assert [e["seq"] for e in over_http] == [e["seq"] for e in events]


@pytest.mark.slow
def test_fault_injection_answers_canned_errors_and_holds_calls(engine, http):
    """The test/soak facility: canned HTTP errors for the next N calls of a route, recorded as injected; held
    calls are served after the delay."""
    since = len(engine.events())
    engine.faults.fail("/pause_generation", 500, "scheduler died", times=2)
    engine.faults.fail("/flush_cache", 400, "Cache not flushed because there are pending requests")
    engine.faults.slow("/continue_generation", 0.5)
    assert http.post(f"{engine.url}/pause_generation", json={"mode": "abort"}).status_code == 500
    answer = http.post(f"{engine.url}/pause_generation", json={"mode": "abort"})
    assert answer.status_code == 500 and answer.json() == {"error": {"message": "scheduler died"}}
    assert http.post(f"{engine.url}/pause_generation", json={"mode": "abort"}).status_code == 200
    assert http.post(f"{engine.url}/flush_cache").status_code == 400
    assert http.post(f"{engine.url}/flush_cache").status_code == 200
    start = time.monotonic()
    assert http.post(f"{engine.url}/continue_generation", json={}).status_code == 200
    assert time.monotonic() - start >= 0.5 and engine.faults.armed() == []
    assert [(e["path"], e["status"], e["message"]) for e in engine.events(since)] == [
        ("/pause_generation", 500, "injected fault: scheduler died"),
        ("/pause_generation", 500, "injected fault: scheduler died"),
        ("/pause_generation", 200, "paused"),
        ("/flush_cache", 400, "injected fault: Cache not flushed because there are pending requests"),
        ("/flush_cache", 200, "flushed"),
        ("/continue_generation", 200, "continued"),
    ]


@pytest.mark.slow
def test_weights_checker_sees_resets_restores_and_flipped_bytes(engine, http, mooncake):
    def check(action, **extra):
        return http.post(f"{engine.url}/weights_checker", json={"action": action, **extra})

    originals = {rank: engine.dump(rank) for rank in range(2)}
    assert check("snapshot").json()["success"] is True
    assert check("reset_tensors").status_code == 200
    assert not torch.equal(engine.dump(0)["model.embed_tokens.weight"], originals[0]["model.embed_tokens.weight"])
    failed = check("compare")
    assert failed.status_code == 400 and failed.json()["success"] is False
    assert "name=model.layers.0.mlp.experts.w13_weight" in failed.json()["message"]

    for rank in range(2):  # restore every parameter with one-sided writes, as a trainer's sync does
        write_params(mooncake, rank_info(engine, http, rank), originals[rank])
    restored = check("compare")
    assert restored.status_code == 200 and restored.json()["success"] is True, restored.text

    assert check("snapshot").status_code == 200  # 0.5.23 drops the snapshot after a successful compare
    name = "model.layers.1.self_attn.o_proj.weight"
    before = engine.dump(1)[name]
    old, new = engine.flip_byte(1, name, 5)
    assert new == old ^ 0xFF
    flipped = check("compare")
    message = flipped.json()["message"]
    assert flipped.status_code == 400 and message.startswith("rank 1: ") and f"name={name} " in message
    assert message.count("name=") == 1
    # As in SGLang 0.5.23, each rank whose compare passed dropped its snapshot (rank 0); rank 1 kept its own.
    again = check("compare").json()["message"]
    assert again.startswith("rank 0: no snapshot") and f"rank 1: check tensor equality failed:\nname={name} " in again
    engine.flip_byte(1, name, 5)
    assert torch.equal(engine.dump(1)[name], before)

    checksum = check("checksum").json()
    assert checksum["success"] and len(checksum["ranks"]) == 2 and "per_engine_checksum" in checksum
    # As in SGLang 0.5.21+: parallelism_info is a list, one entry per runner role
    assert [(i["role"], i["tp_rank"]) for i in checksum["ranks"][1]["parallelism_info"]] == [("target", 1)]
    # the e2e's reader takes both shapes (a dict before 0.5.21)
    both = asyncio.run(checksums_of("loopback", SGLangClient(engine.url, api_key=API_KEY)))
    assert sorted({k.split(":")[0] for k in both}) == ["tp0", "tp1"]
    assert both == {
        f"tp{r['parallelism_info'][0]['tp_rank']}:{n}": v for r in checksum["ranks"] for n, v in r["checksums"].items()
    }


@pytest.mark.slow
def test_frozen_rank_times_out_and_recovers(engine, http):
    engine.freeze_rank(0)
    try:  # answered while the rank is still frozen (thawed only below): the rank timeout, not the thaw, ended it
        answer = http.post(f"{engine.url}/weights_checker", json={"action": "checksum"})
        assert answer.status_code == 400 and "rank 0 is frozen" in answer.json()["message"]
    finally:
        engine.thaw_rank(0)
    assert http.post(f"{engine.url}/weights_checker", json={"action": "checksum"}).status_code == 200


@pytest.mark.slow
def test_killed_rank_is_reported_clearly(engine, http):
    """Destructive: keep last in this module."""
    pid = engine.rank_pid(1)
    engine.kill_rank(1)
    assert not running(pid)
    answer = http.get(f"{engine.url}/remote_instance_transfer_engine_info", params={"rank": 1})
    assert answer.status_code == 400
    assert "rank 1 process is dead (killed by signal 9)" in answer.json()["error"]["message"]
    assert requests.get(f"{engine.bootstrap_url}/get_transfer_engine_info", params={"rank": 1}).status_code == 404
    assert rank_info(engine, http, 0).params  # the other rank still answers
    assert requests.get(f"{engine.url}/health").status_code == 503
    checked = http.post(f"{engine.url}/weights_checker", json={"action": "checksum"})
    assert checked.status_code == 400 and "rank 1 is dead" in checked.json()["message"]


# ------------------------------------------------------------------------------------- the CLI, one rank


@pytest.mark.slow
def test_cli_serves_until_sigterm_and_leaves_no_process(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    cmd = [sys.executable, "-m", "verl_p2p.loopback", "serve", "--model", str(model), "--tp", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "MC_LOG_LEVEL": "ERROR"})
    try:
        ready = json.loads(proc.stdout.readline())
        info = RemoteRankInfo.from_json(
            requests.get(f"{ready['url']}/remote_instance_transfer_engine_info?rank=0").json()
        )
        assert "model.layers.0.mlp.gate_up_proj.weight" in info.params
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert children
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        # the rank template (sandbox/forked.py) exits on its own once the server has: the time its interpreter
        # takes to tear down its imports (seconds on a loaded host), bounded here
        deadline = time.monotonic() + 20
        while [c for c in children if running(int(c))] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [c for c in children if running(int(c))] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

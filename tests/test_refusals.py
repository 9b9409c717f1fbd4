"""What p2p refuses because it cannot be made right, each with the thing named and the fix, and nothing written:

(a) a rollout without weight-update sessions (SGLang 0.5.12) whose model class defines `post_load_weights`
    (the real DeepseekV3ForCausalLM): the sessions fact travels from the servers' begin answers to the trainer's
    assignment on both manager paths, and the trainer refuses before anything is allocated or streamed;
(b) `dp_size > 1` without DP attention, at launch-arg validation (the connect side is in test_layout/fuzz);
(c) streamed HF tensors the rollout cannot take (FP8 into float32 without scales, another dtype or shape, a
    name no rollout parameter takes unless allowed), against a real Mooncake receiver;
(d) published ranges that overlap (inside a rank, or across ranks publishing one session) or are impossible.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from verl_p2p.backend.topology import Assignment, EngineMeta, SourceMeta, TopologyCache
from verl_p2p.config import P2PConfig
from verl_p2p.errors import MalformedAnswerError, P2PConfigError, RemoteMismatchError
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo, TargetRank
from verl_p2p.sandbox.tiny import tiny_config_dict

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

TARGET = TargetRank(0, 0)
SERVER_ARGS = {"tp_size": 1, "ep_size": 1, "dp_size": 1, "dtype": "float32", "version": "0.5.12"}
DEEPSEEK_V3 = tiny_config_dict("deepseek_v3", torch_dtype="float32")  # the sandbox's tiny card


def all_fill(handle, path) -> bool:
    from verl_p2p.transfer.receiver import FILL_BYTE

    return all(bool((b == FILL_BYTE).all()) for b in handle.dump(str(path)).values())


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3 checkpoint (id-encoded float32): its path, config and HF tensors in checkpoint order."""
    from safetensors.torch import load_file

    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.sandbox.tiny import hf_tensor_shapes, write_tiny_checkpoint

    install_cpu_stubs()
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("refusals") / "ckpt", "qwen3")
    cfg = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    return path, cfg, {n: tensors[n] for n, _ in hf_tensor_shapes(cfg)}


# ---- (a) no weight-update sessions + post_load_weights ---------------------------------------------------------


def test_post_load_hook_names_the_model_class_sglang_post_processes(qwen3):
    from verl_p2p.replica.model_class import post_load_hook

    layout = layout_from_server_args(SERVER_ARGS, 0)
    assert post_load_hook(DEEPSEEK_V3, SERVER_ARGS, layout) == "DeepseekV3ForCausalLM.post_load_weights"
    assert post_load_hook(qwen3[1], SERVER_ARGS, layout) is None


def test_sessions_since_is_the_first_release_with_sessions():
    """The refusal names the release that added /begin_weight_update (0.5.21), the one the loopback imitates
    and the rollout client's 404 message name, not a later one."""
    from verl_p2p.loopback.features import Features
    from verl_p2p.replica.model_class import SESSIONS_SINCE

    assert SESSIONS_SINCE == "0.5.21"
    assert Features.of(SESSIONS_SINCE).weight_update_session and not Features.of("0.5.20").weight_update_session


class EngineStandIn:
    """Stand-in for verl's MegatronEngine: what SourceSession reads (model_config) and exports (its stream)."""

    def __init__(self, hf_config, path, hf):
        self.model_config = SimpleNamespace(hf_config=hf_config, local_path=str(path))
        self.hf = hf
        self.exported = 0

    def stream(self):
        for item in self.hf.items():
            self.exported += 1
            yield item


def source_session(monkeypatch, engine):
    from verl_p2p.trainer import verl_engine
    from verl_p2p.trainer.source import SourceSession

    monkeypatch.setattr(verl_engine, "find_megatron_engine", lambda owner: engine)
    monkeypatch.setattr(verl_engine, "engine_exporter", lambda eng, mode: SimpleNamespace(mode="pp_local"))
    monkeypatch.setattr(verl_engine, "export_engine_stage", lambda exporter, eng, **_: eng.stream())
    config = P2PConfig(protocol="tcp", hostname="127.0.0.1", bucket_size_mb=1, release_buffers_on_save=False)
    return SourceSession(config, owner=object(), hostname="127.0.0.1")


def one_target(info: RemoteRankInfo, sessionless: bool) -> Assignment:
    return Assignment(
        1,
        0,
        0,
        1,
        (0,),
        (0,),
        (TARGET,),
        {TARGET: info},
        {TARGET: layout_from_server_args(SERVER_ARGS, 0)},
        {0: SERVER_ARGS},
        sessionless_engines=frozenset({0}) if sessionless else frozenset(),
    )


def test_sessionless_rollout_of_a_post_load_model_is_refused_before_anything_is_allocated(qwen3, monkeypatch):
    from verl_p2p.replica.model_class import PostLoadWithoutSessionsError
    from verl_p2p.trainer.senders import ExportAbortedError

    path, _, hf = qwen3
    engine = EngineStandIn(DEEPSEEK_V3, path, hf)
    session = source_session(monkeypatch, engine)
    info = RemoteRankInfo("127.0.0.1:17000", {"w": RemoteParam(0x1000, 8, 4)})
    session.apply(one_target(info, sessionless=True))  # recorded, reported by the go/no-go
    with pytest.raises(ExportAbortedError) as refused:
        session.push()
    assert isinstance(refused.value.__cause__, PostLoadWithoutSessionsError)
    text = str(refused.value)
    assert "trainer rank 0: PostLoadWithoutSessionsError" in text
    assert "rollout engine 0 runs SGLang 0.5.12 without weight-update sessions" in text
    assert "DeepseekV3ForCausalLM.post_load_weights()" in text
    assert (
        "MLA's absorbed projections w_kc/w_vc (and their FP8 scales w_scale*), rebuilt from kv_b_proj" in text
    )  # what it derives, named
    assert "Fix: run the rollout on SGLang >= 0.5.21" in text and "nothing was written" in text
    assert engine.exported == 0  # nothing streamed, so nothing written
    assert session.transport is None and session.buffers is None and session.writer is None
    session.close()


def test_sessionless_rollout_of_a_model_without_post_load_is_accepted(qwen3, monkeypatch):
    path, cfg, hf = qwen3
    session = source_session(monkeypatch, EngineStandIn(cfg, path, hf))
    info = RemoteRankInfo("127.0.0.1:17000", {"w": RemoteParam(0x1000, 8, 4)})
    session.apply(one_target(info, sessionless=True))
    assert session.apply_error is None and [t.target for t in session.targets] == [TARGET]
    session.close()


def test_sessions_fact_reaches_the_assignment_on_the_engine_path():
    """Leaders report `sessions` (known after begin) in prepare(), also once acknowledged; the driver's plan
    marks the targets of sessionless engines, and a change of the fact re-plans."""
    info = {"tp_size": 1, "dtype": "float32"}
    ranks = {0: RemoteRankInfo("10.0.0.1:17000", {"w": RemoteParam(0x1000, 8, 2)})}
    cache = TopologyCache()
    cache.update_engine(EngineMeta(0, "d0", info, ranks, sessions=False))
    cache.update_engine(EngineMeta(1, "d1", info, {0: RemoteRankInfo("10.0.0.2:17000", ranks[0].params)}, True))
    sources = [SourceMeta(0, 0), SourceMeta(1, 0)]
    generation, assignments = cache.plan(sources, [0, 1])
    marked = {t.engine: a.sessionless_engines for a in assignments.values() for t in a.targets}
    assert marked == {0: frozenset({0}), 1: frozenset()}
    cache.update_engine(EngineMeta(0, "d0", sessions=True))  # acknowledged (slim) answer carries the fact
    again, assignments = cache.plan(sources, [0, 1])
    assert again == generation + 1
    assert all(not a.sessionless_engines for a in assignments.values())


def test_sessions_fact_reaches_the_assignment_on_the_manager_path(monkeypatch):
    import verl  # noqa: F401
    from support.fake_sglang import FakeSGLang
    from test_manager import ActorGroupStandIn, ReplicaStandIn, SourceSessionStandIn
    from verl.workers.config import CheckpointEngineConfig

    from verl_p2p.backend.manager import P2PCheckpointEngineManager
    from verl_p2p.rollout.launch import MEMORY_SAVER, SEED_FLAG

    monkeypatch.setattr("verl_p2p.trainer.source.SourceSession", SourceSessionStandIn)
    monkeypatch.setattr(SourceSessionStandIn, "fail_with", None)
    args = {SEED_FLAG: True, MEMORY_SAVER: False}
    old = FakeSGLang(tp_size=1, version="0.5.12", sessions=False, server_args=args)
    new = FakeSGLang(tp_size=1, version="0.5.23", server_args=args)
    monkeypatch.setattr(SourceSessionStandIn, "servers", {0: old, 1: new})  # what its push writes
    config = CheckpointEngineConfig(backend="p2p", engine_kwargs={"p2p": {"http_timeout": 10}})
    actors = ActorGroupStandIn(world_size=2)
    manager = P2PCheckpointEngineManager(config, actors, [ReplicaStandIn(0, old), ReplicaStandIn(1, new)])
    try:
        manager.update_weights(global_steps=1)
        applied = [e._session.applied[-1] for e in actors.engines]
        marked = {t.engine: a.sessionless_engines for a in applied for t in a.targets}
        assert marked == {0: frozenset({0}), 1: frozenset()}
    finally:
        manager.close()
        old.stop()
        new.stop()


# ---- (b) dp_size > 1 without DP attention, at launch-arg validation ------------------------------------------------


def test_dp_without_dp_attention_is_refused_at_launch_arg_validation():
    from support.compose import OVERLAY, compose_config
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    from verl_p2p.backend.guards import MAIN_PPO, config_problems
    from verl_p2p.rollout import launch

    base = ["--config-name=ppo_megatron_trainer", *OVERLAY, "trainer.v1.trainer_mode=separate_async"]
    cfg = compose_config("verl.trainer.main_ppo", [*base, "actor_rollout_ref.rollout.data_parallel_size=2"])
    (problem,) = config_problems(cfg, MAIN_PPO)
    assert "dp_size=2 without DP attention runs 2 copies" in problem and "same tp_rank" in problem
    assert "enable_dp_attention=true" in problem
    cfg = compose_config(
        "verl.trainer.main_ppo",
        [
            *base,
            "actor_rollout_ref.rollout.data_parallel_size=2",
            "+actor_rollout_ref.rollout.engine_kwargs.sglang.enable_dp_attention=true",
        ],
    )
    assert config_problems(cfg, MAIN_PPO) == []

    rollout = RolloutConfig(
        name="sglang",
        engine_kwargs={"sglang": {**launch.p2p_server_args(7000), "dp_size": 2}},
        checkpoint_engine=CheckpointEngineConfig(backend="verl_p2p"),
    )
    replica = SimpleNamespace(config=rollout, replica_rank=3, rollout_mode=None)
    with pytest.raises(P2PConfigError, match=r"rollout replica 3: dp_size=2 without DP attention"):
        launch.apply_to_replica(replica)


# ---- (c) streamed tensors the rollout cannot take ------------------------------------------------------------------


@pytest.fixture(scope="module")
def wire(qwen3):
    """A real replica of the tiny Qwen3 (TP1), a receiver process holding its parameters, a Mooncake transport."""
    from verl_p2p.replica import RankReplica
    from verl_p2p.transfer.mooncake import MooncakeTransport
    from verl_p2p.transfer.receiver import spec_from_plan, start_receivers, stop_all

    _, cfg, hf = qwen3
    specs = {n: (tuple(t.shape), t.dtype) for n, t in hf.items()}
    replica = RankReplica.build(cfg, SERVER_ARGS, layout_from_server_args(SERVER_ARGS, 0), specs)
    handles = start_receivers({"e0r0": spec_from_plan(replica.plan.params)})
    transport = MooncakeTransport("127.0.0.1", protocol="tcp", timeout_s=10.0)
    yield replica, handles["e0r0"], transport
    stop_all(handles.values())


def push_into(wire, stream, **kwargs):
    from verl_p2p.trainer.push import PushTarget, push
    from verl_p2p.transfer.buffers import TransferBuffers
    from verl_p2p.transfer.writer import Writer

    replica, handle, transport = wire
    handle.fill()
    target = PushTarget(TARGET, replica, handle.remote_info())
    buffers = TransferBuffers(1 << 20, transport)
    writer = Writer(transport, {TARGET: target.remote}, timeout_s=10.0)
    try:
        return push(iter(stream), [target], buffers, writer, **kwargs)
    finally:
        writer.close()
        buffers.release()


@pytest.mark.slow  # a receiver process
def test_fp8_tensor_into_a_float32_plan_is_refused_before_any_write(wire, qwen3, tmp_path):
    from verl_p2p.trainer.stream_checks import StreamRefusedError

    hf = list(qwen3[2].items())
    first, tensor = hf[0]
    with pytest.raises(StreamRefusedError) as refused:
        push_into(wire, [(first, tensor.to(torch.float8_e4m3fn)), *hf[1:]])
    text = str(refused.value)
    assert f"HF tensor {first!r} arrives as torch.float8_e4m3fn" in text and "checkpoint's torch.float32" in text
    assert "FP8 values without their scales" in text and "Fix: export in the checkpoint's dtype" in text
    assert "nothing was written" in text
    assert all_fill(wire[1], tmp_path / "fp8.pt")


@pytest.mark.slow  # a receiver process
def test_a_bad_tensor_mid_stream_names_the_targets_whose_bytes_are_now_unknown(wire, qwen3, tmp_path):
    from verl_p2p.trainer.stream_checks import StreamRefusedError

    hf = list(qwen3[2].items())
    name, tensor = hf[12]
    with pytest.raises(StreamRefusedError) as refused:
        push_into(wire, [*hf[:12], (name, tensor.to(torch.int32)), *hf[13:]])
    text = str(refused.value)
    assert f"HF tensor {name!r} arrives as torch.int32" in text
    assert "bytes of these targets are now unknown (the next sync must rewrite them): engine 0 rank 0" in text
    assert not all_fill(wire[1], tmp_path / "mid.pt")  # what came before it was written


@pytest.mark.slow  # a receiver process
def test_a_tensor_of_another_shape_is_refused_before_any_write(wire, qwen3, tmp_path):
    from verl_p2p.trainer.stream_checks import StreamRefusedError

    hf = list(qwen3[2].items())
    name, tensor = next((n, t) for n, t in hf if t.dim() == 2 and t.shape[0] != t.shape[1])
    with pytest.raises(
        StreamRefusedError, match=rf"{name!r} arrives with shape \({tensor.shape[1]}, {tensor.shape[0]}\)"
    ):
        push_into(wire, [(name, tensor.t().contiguous()), *[(n, t) for n, t in hf if n != name]])
    assert all_fill(wire[1], tmp_path / "shape.pt")


@pytest.mark.slow  # a receiver process
def test_a_name_no_rollout_parameter_takes_is_refused_unless_allowed(wire, qwen3, tmp_path):
    from verl_p2p.trainer.stream_checks import StreamRefusedError

    hf = list(qwen3[2].items())
    stray = ("model.layers.0.mlp.down_proj.weight_scale_inv", torch.ones(4, 4))
    with pytest.raises(StreamRefusedError) as refused:
        push_into(wire, [stray, *hf])
    text = str(refused.value)
    assert f"HF tensor {stray[0]!r}" in text and "no rollout parameter takes it" in text
    assert "unused_hf_tensors_allowed" in text and "nothing was written" in text
    assert all_fill(wire[1], tmp_path / "stray.pt")

    metrics = push_into(wire, [stray, *hf], allowed_unused=("*_scale_inv",))  # allowed: dropped, the rest lands
    replica, handle, _ = wire
    assert metrics.total_bytes == replica.plan.nbytes
    got = handle.dump(str(tmp_path / "allowed.pt"))
    hf_map = dict(hf)
    for name, p in replica.plan.params.items():
        want = torch.empty(p.nbytes, dtype=torch.uint8)
        replica.load(name, {f: hf_map[f] for f in p.feeds}, want)
        assert torch.equal(got[name], want), name


@pytest.mark.slow  # a receiver process
def test_a_published_param_no_sync_writes_is_refused_before_any_write_unless_allowed(wire, qwen3, tmp_path):
    """A rollout rank publishing a parameter outside its write plan: it would keep its start-up value forever."""
    from verl_p2p.errors import RemoteMismatchError
    from verl_p2p.transfer.receiver import FILL_BYTE, spec_from_plan, start_receivers, stop_all

    replica, _, transport = wire
    frozen = "model.layers.0.mlp.frozen_adapter.weight"
    spec = {**spec_from_plan(replica.plan.params), frozen: (16, "float32")}
    handle = start_receivers({"extra": spec})["extra"]
    try:
        ours = (replica, handle, transport)
        with pytest.raises(RemoteMismatchError) as refused:
            push_into(ours, list(qwen3[2].items()))
        text = str(refused.value)
        assert f"engine 0 rank 0: 1 published param(s) no sync writes: [{frozen!r}]" in text
        assert "nothing was written" in text and "unwritten_params_allowed" in text
        assert all_fill(handle, tmp_path / "refused.pt")

        metrics = push_into(ours, list(qwen3[2].items()), unwritten_allowed=("*.frozen_adapter.*",))
        assert metrics.total_bytes == replica.plan.nbytes
        got = handle.dump(str(tmp_path / "allowed.pt"))
        assert bool((got[frozen] == FILL_BYTE).all())  # listed: left as it was
        assert not any(bool((got[n] == FILL_BYTE).all()) for n in replica.plan.params)  # the rest was written
    finally:
        stop_all([handle])


@pytest.mark.slow  # a receiver process
def test_plain_float_casts_are_what_sglang_does_and_are_accepted(wire, qwen3):
    hf = [(n, t.to(torch.bfloat16)) for n, t in qwen3[2].items()]
    assert push_into(wire, hf).total_bytes == wire[0].plan.nbytes


@pytest.mark.slow  # a receiver process
def test_an_fp8_export_into_a_plan_without_fp8_inputs_is_refused_before_streaming(wire, tmp_path):
    from verl_p2p.trainer.push import PushTarget, check_push
    from verl_p2p.trainer.stream_checks import StreamRefusedError
    from verl_p2p.transfer.writer import Writer

    replica, handle, transport = wire
    target = PushTarget(TARGET, replica, handle.remote_info())
    writer = Writer(transport, {TARGET: target.remote}, timeout_s=10.0)
    assert check_push([target], writer)  # the same targets pass without an FP8 export
    with pytest.raises(StreamRefusedError, match="exports FP8 weights .* takes no FP8 tensor"):
        check_push([target], writer, streams_fp8=True)
    writer.close()


def test_the_allow_list_option_parses_and_validates():
    assert P2PConfig.from_mapping({"unused_hf_tensors_allowed": ["*.inv_freq", "mtp.*"]}).unused_hf_tensors_allowed == (
        "*.inv_freq",
        "mtp.*",
    )
    assert P2PConfig.from_mapping({"unused_hf_tensors_allowed": "a,b"}).unused_hf_tensors_allowed == ("a", "b")
    assert P2PConfig().unused_hf_tensors_allowed == ()
    with pytest.raises(P2PConfigError, match="unused_hf_tensors_allowed"):
        P2PConfig.from_mapping({"unused_hf_tensors_allowed": [1, 2]})
    with pytest.raises(P2PConfigError, match="unused_hf_tensors_allowed"):
        P2PConfig.from_mapping({"unused_hf_tensors_allowed": 5})
    assert P2PConfig.from_mapping({"unwritten_params_allowed": "x.*,y"}).unwritten_params_allowed == ("x.*", "y")
    assert P2PConfig().unwritten_params_allowed == ()
    with pytest.raises(P2PConfigError, match="unwritten_params_allowed"):
        P2PConfig.from_mapping({"unwritten_params_allowed": [3]})


# ---- (d) published ranges that overlap or cannot be real ---------------------------------------------------------


class RecordingTransport:
    """Stand-in transport: records write calls, moves no byte (the writer must refuse before any)."""

    session_id = "127.0.0.1:1"

    def __init__(self):
        self.writes = []

    def register(self, addr, nbytes):
        pass

    def unregister(self, addr):
        pass

    def write(self, session_id, local, remote, lengths):
        self.writes.append((session_id, remote, lengths))


def validate(infos, expected):
    from verl_p2p.transfer.writer import Writer

    transport = RecordingTransport()
    writer = Writer(transport, infos, timeout_s=1.0)
    try:
        writer.validate(expected)
    finally:
        writer.close()
    assert transport.writes == []


EXPECTED = {"a": (16, 4), "b": (16, 4)}


def test_overlapping_ranges_inside_one_rank_are_refused_before_any_write():
    info = RemoteRankInfo("10.0.0.1:17000", {"a": RemoteParam(0x1000, 16, 4), "b": RemoteParam(0x1020, 16, 4)})
    with pytest.raises(RemoteMismatchError, match=r"overlap: 'engine 0 rank 0: b' \[0x1020, 0x1060\) starts inside"):
        validate({TARGET: info}, {TARGET: EXPECTED})


def test_ranks_publishing_one_session_must_not_overlap():
    one = TargetRank(0, 1)
    a = RemoteRankInfo("10.0.0.1:17000", {"a": RemoteParam(0x1000, 16, 4), "b": RemoteParam(0x1040, 16, 4)})
    b = RemoteRankInfo("10.0.0.1:17000", {"a": RemoteParam(0x1060, 16, 4), "b": RemoteParam(0x10A0, 16, 4)})
    with pytest.raises(RemoteMismatchError, match="session 10.0.0.1:17000: published ranges overlap"):
        validate({TARGET: a, one: b}, {TARGET: EXPECTED, one: EXPECTED})
    apart = RemoteRankInfo("10.0.0.1:17000", {"a": RemoteParam(0x2000, 16, 4), "b": RemoteParam(0x2040, 16, 4)})
    validate({TARGET: a, one: apart}, {TARGET: EXPECTED, one: EXPECTED})  # one session, disjoint ranges: fine


@pytest.mark.parametrize(
    "param,needle",
    [
        (RemoteParam(0, 16, 4), "address 0 is not a positive address"),
        (RemoteParam(-64, 16, 4), "not a positive address"),
        (RemoteParam(0x1000, 16, 3), "element_size 3 is not one of"),
        (RemoteParam((1 << 64) - 32, 16, 4), "64-bit address space"),
        (RemoteParam(0x1000, 17, 4), "trainer writes numel 16 x 4 B, rollout publishes numel 17 x 4 B"),
    ],
)
def test_impossible_or_disagreeing_entries_are_refused_before_any_write(param, needle):
    info = RemoteRankInfo("10.0.0.1:17000", {"a": param, "b": RemoteParam(0x9000, 16, 4)})
    with pytest.raises(RemoteMismatchError, match=needle.replace("(", r"\(")):
        validate({TARGET: info}, {TARGET: EXPECTED})


def test_rank_info_parsing_accepts_what_sglang_sends_and_refuses_overlaps():
    answer = {
        "rank": 0,
        "remote_instance_transfer_engine_info": ["[fe80::1]:17000", {"a": [0x1000, 16, 4, "later"]}, "later"],
    }
    info = RemoteRankInfo.from_json(answer)  # an IPv6 session, elements a later release may append: ignored
    assert info.session_id == "[fe80::1]:17000" and info.params["a"] == RemoteParam(0x1000, 16, 4)
    overlapping = {"remote_instance_transfer_engine_info": ["h:1", {"a": [0x1000, 16, 4], "b": [0x1010, 4, 4]}]}
    with pytest.raises(MalformedAnswerError, match="published parameters overlap"):
        RemoteRankInfo.from_json(overlapping)


def test_leader_reports_sessions_after_begin(monkeypatch):
    """The rollout leader's prepare() carries the begin answer's fact (sessions False on SGLang 0.5.12)."""
    from support.fake_sglang import FakeSGLang
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.single_controller.base import Worker

    from verl_p2p.backend import engine as engine_module
    from verl_p2p.rollout.launch import BOOTSTRAP_PORT, MEMORY_SAVER, SEED_FLAG

    class RolloutWorkerStandIn(Worker):
        """Stand-in for verl's CheckpointEngineWorker: builds the backend the same way (no is_master)."""

        def __init__(self):  # Worker.__init__ skipped: it needs a Ray worker's env
            self.rollout_config = SimpleNamespace(name="sglang")
            self.server_adapter = SimpleNamespace(replica_rank=0, rollout_rank=0)
            self.checkpoint_engine = CheckpointEngineRegistry.new("verl_p2p", bucket_size=1 << 20)

    with FakeSGLang(
        tp_size=1, version="0.5.12", sessions=False, server_args={SEED_FLAG: True, MEMORY_SAVER: False}
    ) as fake:
        fake.server_args.update(host="127.0.0.1", **{BOOTSTRAP_PORT: int(fake.bootstrap_url.rsplit(":", 1)[1])})
        fake.paused = True
        monkeypatch.setattr(engine_module, "_server_url", lambda replica: fake.url)
        worker = RolloutWorkerStandIn()  # the engine holds it weakly, as verl's worker holds the engine
        engine = worker.checkpoint_engine
        meta = engine.prepare()["engine"]
        assert meta.sessions is False and meta.rank_infos is not None
        engine.init_process_group(ack=meta.digest)
        engine.receive_weights(global_steps=1)
        engine.finalize()
        assert engine.prepare()["engine"] == EngineMeta(0, meta.digest, sessions=False)  # acked: slim, with the fact


# ---- the sync's error names each cause once -------------------------------------------------------------------


@pytest.mark.parametrize("mine", [True, False])
def test_send_weights_reports_a_go_no_go_abort_by_its_cause(monkeypatch, mine):
    import asyncio

    from test_engine_roles import SourceSessionStandIn, assignment
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from verl_p2p.errors import P2PError
    from verl_p2p.trainer.senders import ExportAbortedError

    monkeypatch.setattr("verl_p2p.trainer.source.SourceSession", SourceSessionStandIn)
    trainer = CheckpointEngineRegistry.new("verl_p2p", is_master=True, bucket_size=1 << 20)
    trainer.init_process_group(assignment=assignment(1, [TARGET]))
    failures = {0 if mine else 1: "RemoteMismatchError: param 'w': numel 8 vs 9"}
    monkeypatch.setattr(SourceSessionStandIn, "fail_with", ExportAbortedError((0, 1), failures))
    with pytest.raises(P2PError) as failed:
        asyncio.run(trainer.send_weights(None, global_steps=4))
    text = str(failed.value)
    if mine:
        assert "trainer rank 0: RemoteMismatchError: param 'w': numel 8 vs 9" in text
    else:
        assert (
            "trainer rank 0: did not export: its export group's go/no-go stopped it (trainer rank(s) 1 refused)" in text
        )


def test_mla_derivation_is_allowed_only_from_its_own_kv_b_proj():
    """The allow-list is not a blanket pass: w_kc computed from anything but its module's written kv_b_proj,
    or a derived tensor of another name, is unexplained (and refused at capture / check_syncable)."""
    from verl_p2p.replica.derived import unexplained

    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    feeds = {kv_b: (kv_b,), "model.layers.0.self_attn.q_b_proj.weight": ("model.layers.0.self_attn.q_b_proj.weight",)}
    assert unexplained({"model.layers.0.self_attn.w_kc": frozenset({kv_b})}, feeds) == {}
    impure = unexplained(
        {"model.layers.0.self_attn.w_kc": frozenset({kv_b, "model.layers.0.self_attn.q_b_proj.weight"})}, feeds
    )
    assert "q_b_proj" in impure["model.layers.0.self_attn.w_kc"]
    other_layer = unexplained({"model.layers.1.self_attn.w_kc": frozenset({kv_b})}, feeds)
    assert other_layer == {"model.layers.1.self_attn.w_kc": "no allow-listed derivation builds it"}
    assert "model.layers.0.mlp.w13_packed" in unexplained({"model.layers.0.mlp.w13_packed": frozenset({kv_b})}, feeds)


def test_derivations_known_not_rebuilt_at_session_end_are_named_with_their_evidence():
    """GemmaRMSNorm's gemma_weight (Qwen3-Next, Qwen3.5) is computed by the norm's weight loader, which SGLang's
    /end_weight_update never re-runs: the refusal names it as such; MLA's w_kc (allow-listed) is not among them."""
    from verl_p2p.replica.derived import known_not_rebuilt

    found = known_not_rebuilt(
        ["model.layers.0.input_layernorm.gemma_weight", "model.layers.0.self_attn.w_kc", "model.norm.gemma_weight"]
    )
    ((what, names),) = found.items()
    assert what.startswith("GemmaRMSNorm's gemma_weight") and "never re-runs a weight loader" in what
    assert names == ["model.layers.0.input_layernorm.gemma_weight", "model.norm.gemma_weight"]
    assert known_not_rebuilt(["model.layers.0.self_attn.w_kc"]) == {}


def test_sessions_fact_reaches_the_assignment_on_the_demo_and_e2e_path():
    """The demo and the e2e harness plan through `sole_source_assignment`: the lifecycle's sessionless engines
    (a 0.5.12 server, before its first begin: what its release says) mark their targets there too, so a post-load
    model into such a rollout is refused by the trainer before any write (it once failed deep in SGLang's model
    init instead, with no word of sessions)."""
    import asyncio

    from support.fake_sglang import FakeSGLang

    from verl_p2p.backend.topology import sole_source_assignment
    from verl_p2p.rollout.adapter import P2PReplicaAdapter
    from verl_p2p.rollout.lifecycle import SyncLifecycle

    old, new = FakeSGLang(version="0.5.12", sessions=False), FakeSGLang(version="0.5.23")
    config = P2PConfig(protocol="tcp", hostname="127.0.0.1", http_timeout=10.0)
    adapters = [P2PReplicaAdapter(i, s.url, config=config) for i, s in enumerate((old, new))]
    lifecycle = SyncLifecycle(adapters, config, frees_kv=True)
    seen = []

    async def prepare(connection):
        seen.append(
            (lifecycle.sessionless_engines(), sole_source_assignment(connection, lifecycle.sessionless_engines()))
        )

    async def push(connection):
        return {}

    try:
        asyncio.run(lifecycle.sync(1, push, prepare=prepare))
        sessionless, assignment = seen[0]  # the plan made before the pause: from the release alone
        assert sessionless == (0,)
        assert {t.engine for t in assignment.targets} == {0, 1}
        assert assignment.sessionless_engines == frozenset({0})
        assert lifecycle.sessionless_engines() == (0,)  # and after its begin answered 404
    finally:
        lifecycle.close()
        old.stop()
        new.stop()

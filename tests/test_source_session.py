"""SourceSession, the engine's seam to the data plane, over the real parts: RankReplica (SGLang's model classes),
Mooncake tcp transport, registered transfer buffers, writer, push and export_stage.drive_export, writing into a
real receiver process that holds a rollout rank's parameters.

Stand-in: verl's Megatron engine and its stage exporter (the HF stream is the tiny checkpoint's tensors).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from types import SimpleNamespace

import pytest

from verl_p2p.backend.topology import Assignment
from verl_p2p.config import P2PConfig
from verl_p2p.errors import TransferError
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.planning.targets import TargetRank

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytestmark = pytest.mark.slow

SERVER_ARGS = {"tp_size": 1, "ep_size": 1, "dp_size": 1, "dtype": "float32"}
TARGET = TargetRank(0, 0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from safetensors.torch import load_file

    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.sandbox.tiny import hf_tensor_shapes, write_tiny_checkpoint

    install_cpu_stubs()
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("source") / "ckpt", "qwen3")
    cfg = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    return cfg, path, [(n, tensors[n]) for n, _ in hf_tensor_shapes(cfg)]


@pytest.fixture(scope="module")
def receiver(model):
    from verl_p2p.replica import RankReplica
    from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint
    from verl_p2p.transfer.receiver import spec_from_plan, start_receivers, stop_all

    cfg, path, _ = model
    server_args = {**SERVER_ARGS, "model_path": str(path)}
    plan = RankReplica.build(cfg, server_args, layout_from_server_args(server_args, 0), hf_specs_from_checkpoint(path))
    handles = start_receivers({"e0r0": spec_from_plan(plan.plan.params)})
    yield handles["e0r0"], {n: p.nbytes for n, p in plan.plan.params.items()}
    stop_all(handles.values())


class EngineStandIn:
    """Stand-in for verl's MegatronEngine: what SourceSession reads (model_config) and exports (its stream)."""

    def __init__(self, cfg, path, hf):
        self.model_config = SimpleNamespace(hf_config=cfg, local_path=str(path))
        self.hf = hf
        self.exported = 0

    def stream(self):
        for item in self.hf:
            self.exported += 1
            yield item


def make_session(model, monkeypatch, **options):
    from verl_p2p.trainer import verl_engine
    from verl_p2p.trainer.source import SourceSession

    engine = EngineStandIn(*model)
    monkeypatch.setattr(verl_engine, "find_megatron_engine", lambda owner: engine)
    monkeypatch.setattr(verl_engine, "engine_exporter", lambda eng, mode: SimpleNamespace(mode=mode))
    monkeypatch.setattr(verl_engine, "export_engine_stage", lambda exporter, eng, **_: eng.stream())
    config = P2PConfig(protocol="tcp", hostname="127.0.0.1", bucket_size_mb=1, release_buffers_on_save=False, **options)
    return SourceSession(config, owner=object(), hostname=config.hostname), engine


@pytest.fixture
def session(model, monkeypatch):
    session, engine = make_session(model, monkeypatch)
    yield session, engine
    session.close()


def assignment(generation: int, receiver=None, path=None) -> Assignment:
    if receiver is None:  # idle: the stage has another sender
        return Assignment(generation, 0, 0, 1, (0, 1), (1,))
    server_args = {**SERVER_ARGS, "model_path": str(path)}
    return Assignment(
        generation,
        0,
        0,
        1,
        (0,),
        (0,),
        (TARGET,),
        {TARGET: receiver.remote_info()},
        {TARGET: layout_from_server_args(server_args, 0)},
        {0: server_args},
    )


def test_source_session_writes_every_parameter_of_its_target(session, receiver, model, tmp_path, monkeypatch):
    session, engine = session
    handle, nbytes = receiver
    _, path, hf = model
    assert session.transport is None  # nothing allocated before a plan with targets

    from verl_p2p.transfer.mooncake import MooncakeTransport

    reads, read = [], MooncakeTransport.read
    monkeypatch.setattr(MooncakeTransport, "read", lambda self, sid, *a: (reads.append(sid), read(self, sid, *a))[1])
    before = handle.digest()
    session.apply(assignment(1, handle, path))
    assert reads == [handle.remote_info().session_id]  # the connection is opened at apply, before the pause
    assert handle.digest() == before  # by a read: nothing written
    metrics = session.push()
    assert metrics.total_bytes == sum(nbytes.values())
    assert engine.exported == len(hf)
    written = handle.dump(str(tmp_path / "dump.pt"))
    untouched = [n for n, t in written.items() if bool((t == 0xFF).all())]
    assert untouched == [] and set(written) == set(nbytes)

    session.apply(assignment(2, handle, path))  # same layout: the replica is reused, not rebuilt
    assert len(session._replicas) == 1
    assert session.push().total_bytes == sum(nbytes.values())


def test_idle_rank_runs_the_export_without_transport(session, model):
    session, engine = session
    _, _, hf = model
    session.apply(assignment(1))
    assert session.push() is None
    assert engine.exported == len(hf)  # drained: the stage's collectives would have matched
    assert session.transport is None and session.buffers is None


def test_executor_options_reach_the_push(model, receiver, monkeypatch, tmp_path):
    """executor=compiled (default) pushes through copy programs; verify_first_push checks each plan generation's
    programs against SGLang's loader at apply (before the pause), so the push itself checks nothing;
    executor=sglang pushes through SGLang's loader."""
    from verl_p2p.replica import CompiledReplica, RankReplica

    handle, nbytes = receiver
    _, path, _ = model
    checks: list[int] = []
    original = CompiledReplica.prepare_push
    monkeypatch.setattr(
        CompiledReplica, "prepare_push", lambda self, *a, **k: checks.append(original(self, *a, **k)) or checks[-1]
    )
    session, _ = make_session(model, monkeypatch, verify_first_push=True)
    try:
        session.apply(assignment(1, handle, path))
        (target,) = session.targets
        assert isinstance(target.replica, CompiledReplica) and not target.replica.verifying
        assert checks == [len(target.replica.plan.params)]  # every parameter checked at apply
        assert session.buffers.device.type == "cpu"  # staging=auto on a host without CUDA: host slots
        loads = []
        reference_load = target.replica.reference.load
        target.replica.reference.load = lambda *a: (loads.append(a[0]), reference_load(*a))[1]
        assert session.push().total_bytes == sum(nbytes.values())
        assert loads == [] and not target.replica.verifying  # the push ran the checked programs only
        session.apply(assignment(2, handle, path))
        assert session.targets[0].replica is target.replica and len(checks) == 2  # a new generation: checked again
        assert session.push().total_bytes == sum(nbytes.values()) and not target.replica.verifying
    finally:
        session.close()
    session, _ = make_session(model, monkeypatch, executor="sglang")
    try:
        session.apply(assignment(1, handle, path))
        assert isinstance(session.targets[0].replica, RankReplica)
        handle.fill()
        session.push()
        written = handle.dump(str(tmp_path / "sglang.pt"))
        assert not [n for n, t in written.items() if bool((t == 0xFF).all())]
    finally:
        session.close()


def test_engines_differing_in_any_byte_relevant_arg_get_their_own_replica(model, monkeypatch, tmp_path):
    """The trainer caches replicas by the replica's own key: `moe_dense_tp_size` is not one of the driver's
    placement args, yet an engine with it set gets a replica of its own; an instance field (the port) does not."""
    session, _ = make_session(model, monkeypatch, plan_cache_dir=str(tmp_path / "plans"))
    layout = layout_from_server_args(SERVER_ARGS, 0)
    first = session._replica(dict(SERVER_ARGS, port=30000), layout)
    assert session._replica(dict(SERVER_ARGS, port=30001), layout) is first
    other = session._replica(dict(SERVER_ARGS, moe_dense_tp_size=1), layout)
    assert other is not first and other.key != first.key
    assert other.key[2] == other.ctx.fingerprint  # the key is the rank context's own


def test_warm_up_reads_into_scratch_of_its_own_and_never_inside_the_pause(model, receiver, monkeypatch):
    """Review finding 2: the read that opens a target's connection before the pause lands in a small registered
    scratch buffer, never in a transfer slot (a failed read may land late, over a parameter loaded there); a plan
    handed out inside the pause (`warm_up=False`: a re-push's) reads nothing."""
    from verl_p2p.transfer.mooncake import MooncakeTransport

    handle, _ = receiver
    _, path, _ = model
    reads, read = [], MooncakeTransport.read
    monkeypatch.setattr(
        MooncakeTransport, "read", lambda self, sid, local, *a: (reads.append(local[0]), read(self, sid, local, *a))[1]
    )
    session, _ = make_session(model, monkeypatch)
    try:
        session.apply(assignment(1, handle, path))
        assert session.apply_error is None and len(reads) == 1
        slots = [(s.addr, s.addr + s.nbytes) for s in session.buffers.slots]
        assert not any(lo <= reads[0] < hi for lo, hi in slots)  # before the fix: slot 0's address
        assert reads[0] == session.buffers.scratch()
        session.apply(dataclasses.replace(assignment(2, handle, path), warm_up=False))
        assert session.apply_error is None and len(reads) == 1  # inside the pause: no read
        session.push()
    finally:
        session.close()


def test_a_write_still_in_flight_keeps_its_target_failed_across_plan_generations(
    model, receiver, monkeypatch, tmp_path
):
    """Review finding 3: a write blocked in Mooncake (frozen receiver) outlives its push and its Writer; the next
    plan generation's Writer must not write that target while the old call can still land over the new bytes.
    Once the call returned, the target is written again as usual."""
    handle, nbytes = receiver
    _, path, _ = model
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "60")  # Mooncake's own give-up far past ours: the call stays blocked
    session, _ = make_session(model, monkeypatch, p2p_transfer_timeout=1.0)
    session_id = handle.remote_info().session_id
    try:
        session.apply(assignment(1, handle, path))
        session.push()  # connected; every byte landed
        handle.freeze()
        try:
            with pytest.raises(TransferError, match="timed out after 1 s"):
                session.push()
            session.apply(assignment(2, handle, path))  # a re-plan: a new Writer (before the fix: a fresh state)
            with pytest.raises(TransferError) as err:
                session.push()
            assert "still in flight" in str(err.value) and "engine 0 rank 0" in str(err.value)
            assert session.inflight.busy(session_id)  # the first push's call: still blocked inside Mooncake
        finally:
            handle.thaw()
        deadline = time.monotonic() + 60
        while session.inflight.busy(session_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not session.inflight.busy(session_id)
        handle.fill()
        session.apply(assignment(3, handle, path))
        assert session.push().total_bytes == sum(nbytes.values())
        written = handle.dump(str(tmp_path / "dump.pt"))
        assert [n for n, t in written.items() if bool((t == 0xFF).all())] == []
    finally:
        session.close()

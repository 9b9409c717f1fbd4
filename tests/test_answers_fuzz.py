"""Malformed rollout answers never reach a write: 85 rank-info and server-info answers (a deterministic fuzz,
tests/support/answers.py: wrong types, missing keys, negative/overlapping/out-of-range addresses, zero and huge
sizes, bad session ids, inconsistent tp/ep/dp, missing flags), each served over HTTP and taken down the production
path from the answer to the trainer's writes. Each is refused with a P2PError subclass whose message names what is
wrong, and the transport is never asked to write. The valid answers, on the same path, write every byte."""

from __future__ import annotations

import json

import pytest
from support.answers import (
    SERVER_ARGS,
    TP,
    VERSION,
    Case,
    RecordingTransport,
    connect_and_push,
    rank_info_cases,
    serve_valid,
    server_info_cases,
    valid_rank_info,
)
from support.fake_sglang import FakeSGLang

from verl_p2p.errors import P2PError

RANK_CASES = rank_info_cases()
SERVER_CASES = server_info_cases()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny checkpoint both sides load, a replica cache, and the valid rank info of every rank."""
    from safetensors.torch import load_file

    from verl_p2p.backend.topology import layout_key
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica import RankReplica
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.sandbox.tiny import hf_tensor_shapes, write_tiny_checkpoint

    install_cpu_stubs()
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("fuzz") / "ckpt", "qwen3")
    cfg = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    hf = {n: tensors[n] for n, _ in hf_tensor_shapes(cfg)}
    specs = {n: (tuple(t.shape), t.dtype) for n, t in hf.items()}
    cache: dict = {}

    def replica_for(server_info, layout):
        key = layout_key(server_info, layout)
        if key not in cache:
            cache[key] = RankReplica.build(cfg, server_info, layout, specs)
        return cache[key]

    served = {**SERVER_ARGS, "version": VERSION}
    valid = {
        r: valid_rank_info(replica_for(served, layout_from_server_args(served, r)).plan.params, r) for r in range(TP)
    }
    return replica_for, hf, valid


def run(world, case: Case | None) -> tuple[RecordingTransport, BaseException | None, object]:
    replica_for, hf, valid = world
    transport = RecordingTransport()
    with FakeSGLang(tp_size=TP, version=VERSION, server_args=dict(SERVER_ARGS), bootstrap=False) as fake:
        serve_valid(fake, valid)
        if case is not None:
            case.apply(fake)
        try:
            return transport, None, connect_and_push(fake.url, replica_for, hf, transport)
        except Exception as exc:  # judged by the caller
            return transport, exc, None


def test_the_fuzz_has_at_least_50_distinct_cases():
    assert len(RANK_CASES) + len(SERVER_CASES) >= 50
    assert len({c.id for c in RANK_CASES + SERVER_CASES}) == len(RANK_CASES) + len(SERVER_CASES)


def test_valid_answers_write_every_byte(world):
    """The harness sees writes: the same path with the valid answers pushes every parameter of both ranks."""
    replica_for, _, valid = world
    transport, error, metrics = run(world, None)
    assert error is None, error
    assert metrics.total_bytes > 0 and transport.writes
    written = sum(sum(lengths) for _, _, lengths in transport.writes)
    assert written == metrics.total_bytes
    assert {session for session, _, _ in transport.writes} == {info[0] for info in valid.values()}


@pytest.mark.parametrize("case", RANK_CASES + SERVER_CASES, ids=lambda c: c.id)
def test_malformed_answer_is_refused_by_name_and_nothing_is_written(world, case):
    transport, error, _ = run(world, case)
    assert error is not None, f"{case.id}: accepted"
    assert isinstance(error, P2PError), f"{case.id}: {type(error).__name__}: {error}"  # never a bare KeyError...
    assert case.needle in str(error), f"{case.id}: {type(error).__name__}: {error}"
    assert transport.writes == [], f"{case.id}: {len(transport.writes)} write call(s) after a malformed answer"

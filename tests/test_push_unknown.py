"""A failed push reports as unknown every target whose completeness it cannot prove (review defect 1).

Two rollout ranks A and B (real receiver processes, real Mooncake tcp writes) share one replica; A's process is
dead, so its writes fail. When the HF stream also lacks a tensor both need, B is left half-written: the error
must name B unknown too (not only A), or the lifecycle would version and resume B with old and new weights mixed.
"""

from __future__ import annotations

import os

import pytest
import torch

from verl_p2p.errors import unknown_targets_of
from verl_p2p.planning.targets import TargetRank
from verl_p2p.replica.plan import ParamPlan, RecordedWrite, SourceView, WritePlan
from verl_p2p.replica.stream import CompletenessStager
from verl_p2p.trainer.push import IncompletePushError, PushTarget, push
from verl_p2p.transfer.buffers import TransferBuffers
from verl_p2p.transfer.mooncake import MooncakeTransport
from verl_p2p.transfer.receiver import spec_from_plan, start_receivers, stop_all
from verl_p2p.transfer.writer import Writer

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

A, B = TargetRank(0, 0), TargetRank(1, 0)


def _param(name: str, hf: str) -> ParamPlan:
    write = RecordedWrite("copy", 0, (4,), (1,), SourceView(hf, 0, (4,), (1,)), feeds=(hf,))
    return ParamPlan(name, (4,), torch.float32, 16, (hf,), (write,))


PLAN = WritePlan(
    {"p1": _param("p1", "h1"), "p2": _param("p2", "h2")},
    {"h1": ((4,), torch.float32), "h2": ((4,), torch.float32)},
)


class OneToOne:
    """A replica whose rank holds each HF tensor unchanged (p1 <- h1, p2 <- h2): the plan above, executed."""

    key = "one-to-one"
    plan = PLAN

    def stager(self) -> CompletenessStager:
        return CompletenessStager(PLAN)

    def load(self, name, feeds, dst) -> None:
        dst.view(torch.float32).copy_(feeds[PLAN.params[name].feeds[0]])

    def chunks(self, name, max_bytes):
        return [(0, PLAN.params[name].nbytes)]

    def load_chunk(self, name, feeds, offset, dst) -> None:
        self.load(name, feeds, dst)


@pytest.fixture(scope="module")
def ranks():
    handles = start_receivers({"A": spec_from_plan(PLAN.params), "B": spec_from_plan(PLAN.params)})
    infos = {A: handles["A"].remote_info(), B: handles["B"].remote_info()}
    handles["A"].kill()  # A's server died: every write to it fails
    yield infos, handles["B"]
    stop_all(handles.values())


def _push(infos, stream):
    transport = MooncakeTransport("127.0.0.1", protocol="tcp", timeout_s=5.0)
    targets = [PushTarget(t, OneToOne(), infos[t]) for t in (A, B)]
    writer = Writer(transport, infos, timeout_s=5.0)
    buffers = TransferBuffers(1 << 16, transport)
    try:
        return push(iter(stream), targets, buffers, writer)
    finally:
        writer.close()
        buffers.release()


def test_a_write_failure_does_not_hide_an_incomplete_export(ranks):
    infos, _ = ranks
    with pytest.raises(IncompletePushError) as err:
        _push(infos, [("h1", torch.ones(4))])  # h2 never comes: p2 is written on neither rank
    assert unknown_targets_of(err.value) == {A, B}  # before the fix: {A}, and B was resumed half-written
    msg = str(err.value)
    assert "engine 1 rank 0" in msg and "p2" in msg and "h2" in msg  # B named incomplete
    assert f"engine 0 rank 0 (session {infos[A].session_id})" in msg  # and A's failed writes named too


def test_a_complete_export_leaves_only_the_failed_target_unknown(ranks):
    infos, b = ranks
    b.fill()
    with pytest.raises(Exception) as err:
        _push(infos, [("h1", torch.ones(4)), ("h2", torch.full((4,), 2.0))])
    assert not isinstance(err.value, IncompletePushError)
    assert unknown_targets_of(err.value) == {A}  # B's every byte was written: proven complete
    got = b.digest()
    expected = {}
    import hashlib

    for name, value in (("p1", torch.ones(4)), ("p2", torch.full((4,), 2.0))):
        expected[name] = hashlib.blake2b(value.view(torch.uint8).numpy(), digest_size=16).hexdigest()
    assert got == expected

"""Parts of a rollout rank shared by several senders (review findings 14, 15): computed once on the driver from the
target's published parameters, carried in each sender's Assignment, proven disjoint and complete there; a sender
refuses a part naming parameters its own plan lacks; an FP8 sender quantizes only its part's weights.

Stand-in (named as such): `BytesReplica`, a replica whose rank holds each HF weight's bytes unchanged (the FP8
test needs a plan of FP8 weights with their scales; SGLang's FP8 loaders are covered by test_replica_fp8). The
receiver process, the Mooncake tcp writes, the push, the quantizer and the driver's planning are the real ones.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from verl_p2p.backend.topology import SourceMeta, assign, check_parts
from verl_p2p.errors import P2PError, RemoteMismatchError
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo, TargetRank
from verl_p2p.replica.plan import ParamPlan, RecordedWrite, SourceView, WritePlan
from verl_p2p.replica.stream import CompletenessStager
from verl_p2p.trainer.push import PushTarget, check_part_names, group_targets, push

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

SERVER_ARGS = {"tp_size": 1, "dtype": "float32"}
TARGET = TargetRank(0, 0)
NAMES = [f"layers.{i}.weight" for i in range(6)]


def published(names=NAMES, nbytes=lambda i: 64 * (i + 1)) -> RemoteRankInfo:
    params = {n: RemoteParam(4096 * (i + 1), nbytes(i) // 4, 4) for i, n in enumerate(names)}
    return RemoteRankInfo("127.0.0.1:1", params)


def driver_assignments(senders: int, exclude=()):
    sources = [SourceMeta(r, 0) for r in range(senders)]
    infos = {TARGET: published()}
    layouts = {TARGET: layout_from_server_args(SERVER_ARGS, 0)}
    return assign(sources, {0: SERVER_ARGS}, infos, layouts, generation=1, exclude=exclude), infos


def test_the_driver_ships_disjoint_complete_parts_and_refuses_divergent_ones():
    assignments, infos = driver_assignments(3)
    parts = [assignments[r].part_names[TARGET] for r in range(3)]
    assert [assignments[r].parts[TARGET] for r in range(3)] == [(0, 3), (1, 3), (2, 3)]
    assert all(parts) and set().union(*parts) == set(NAMES) and sum(map(len, parts)) == len(NAMES)

    overlapping = dict(assignments)
    overlapping[1] = dataclasses.replace(
        assignments[1], part_names={TARGET: assignments[1].part_names[TARGET] | {next(iter(parts[0]))}}
    )
    with pytest.raises(P2PError, match=r"ranks 0 and 1 both write|ranks 1 and 0 both write"):
        check_parts(overlapping, infos)

    lacking = dict(assignments)
    lacking[2] = dataclasses.replace(assignments[2], part_names={TARGET: frozenset(sorted(parts[2])[1:])})
    with pytest.raises(P2PError, match=r"no sender writes \['layers\.\d\.weight'\] \(1 in all\)"):
        check_parts(lacking, infos)


def test_a_re_push_without_any_sender_of_a_stage_is_refused():
    assignments, _ = driver_assignments(2, exclude={1})
    assert assignments[1].targets == () and assignments[0].targets == (TARGET,) and not assignments[0].parts
    with pytest.raises(P2PError, match=r"no trainer rank of pipeline stage\(s\) \[0\] can send"):
        driver_assignments(2, exclude={0, 1})


class BytesReplica:
    """Stand-in replica: rank parameter `n` is HF tensor `n`'s bytes (fed by it and, for FP8, by its scales)."""

    key = "bytes"

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan

    def stager(self) -> CompletenessStager:
        return CompletenessStager(self.plan)

    def load(self, name, feeds, dst) -> None:
        dst.copy_(feeds[name].contiguous().view(torch.uint8).flatten())

    def chunks(self, name, max_bytes):
        return [(0, self.plan.params[name].nbytes)]

    def load_chunk(self, name, feeds, offset, dst) -> None:
        self.load(name, feeds, dst)


def fp8_plan(names) -> WritePlan:
    params, specs = {}, {}
    for n in names:
        scale = n.removesuffix("weight") + "weight_scale_inv"
        view = SourceView(n, 0, (128, 128), (128, 1))
        write = RecordedWrite("copy", 0, (128, 128), (128, 1), view, feeds=(n,))
        params[n] = ParamPlan(n, (128, 128), torch.float8_e4m3fn, 128 * 128, (n, scale), (write,))
        specs[n] = ((128, 128), torch.float8_e4m3fn)
        specs[scale] = ((1, 1), torch.float32)
    return WritePlan(params, specs)


def test_a_sender_refuses_a_part_naming_parameters_its_plan_lacks():
    assignments, infos = driver_assignments(2)
    mine = assignments[0]
    names = mine.part_names[TARGET]
    diverged = BytesReplica(fp8_plan([n for n in NAMES if n != sorted(names)[0]]))  # its plan lacks one of them
    (group,) = group_targets([PushTarget(TARGET, diverged, infos[TARGET], mine.parts[TARGET], names)])
    with pytest.raises(RemoteMismatchError, match=rf"lacks \(\['{sorted(names)[0]}'\]\).*plans of this rollout rank"):
        check_part_names(group)
    check_part_names(group_targets([PushTarget(TARGET, BytesReplica(fp8_plan(NAMES)), infos[TARGET])])[0])


def test_an_fp8_sender_of_a_part_quantizes_only_its_part(monkeypatch):
    from verl_p2p.trainer import fp8_stream
    from verl_p2p.transfer.buffers import TransferBuffers
    from verl_p2p.transfer.mooncake import MooncakeTransport
    from verl_p2p.transfer.receiver import spec_from_plan, start_receivers, stop_all
    from verl_p2p.transfer.writer import Writer

    plan = fp8_plan(NAMES)
    quantized: list[str] = []
    real = fp8_stream.quantize_many

    def counting(tensors, block, names, **kwargs):
        quantized.extend(names)
        return real(tensors, block, names, **kwargs)

    monkeypatch.setattr(fp8_stream, "quantize_many", counting)
    handles = start_receivers({"r": spec_from_plan(plan.params)})
    try:
        info = handles["r"].remote_info()
        sizes = {n: int(p.nbytes) for n, p in plan.params.items()}
        sources = [SourceMeta(r, 0) for r in range(2)]
        layouts = {TARGET: layout_from_server_args(SERVER_ARGS, 0)}
        assignment = assign(sources, {0: SERVER_ARGS}, {TARGET: info}, layouts, generation=1)[1]
        part = assignment.part_names[TARGET]
        assert 0 < len(part) < len(NAMES) and set(part) <= set(sizes)
        torch.manual_seed(0)
        stream = [(n, torch.randn(128, 128, dtype=torch.bfloat16)) for n in NAMES]
        transport = MooncakeTransport("127.0.0.1", protocol="tcp", timeout_s=10.0)
        target = PushTarget(TARGET, BytesReplica(plan), info, assignment.parts[TARGET], part)
        writer = Writer(transport, {TARGET: info}, timeout_s=10.0)
        buffers = TransferBuffers(1 << 16, transport)
        try:
            metrics = push(iter(stream), [target], buffers, writer)
        finally:
            writer.close()
            buffers.release()
        assert sorted(quantized) == sorted(part), f"quantized {sorted(quantized)}, its part is {sorted(part)}"
        assert metrics.bytes_per_target[TARGET] == sum(sizes[n] for n in part)
    finally:
        stop_all(handles.values())


def test_fsdp_ranks_each_get_a_driver_computed_part_of_every_target_and_a_dead_one_none():
    """FSDP ranks (`full_stream`) all send: the driver plans each onto a part of every target, not the
    `ranks // targets` senders a Megatron stage gets; a rank the re-push excludes gets nothing and the others
    share the target; FSDP and Megatron ranks in one trainer are refused."""
    targets = [TargetRank(0, 0), TargetRank(0, 1)]
    infos = {t: published() for t in targets}
    layouts = {t: layout_from_server_args({**SERVER_ARGS, "tp_size": 2}, t.rank) for t in targets}
    args = {0: {**SERVER_ARGS, "tp_size": 2}}
    sources = [SourceMeta(r, 0, full_stream=True) for r in range(4)]
    assignments = assign(sources, args, infos, layouts, generation=1)
    for t in targets:
        parts = [assignments[r].part_names[t] for r in range(4)]
        assert [assignments[r].parts[t] for r in range(4)] == [(i, 4) for i in range(4)]
        assert set().union(*parts) == set(NAMES) and sum(map(len, parts)) == len(NAMES)

    again = assign(sources, args, infos, layouts, generation=2, exclude={2})
    assert again[2].targets == ()
    assert {again[r].parts[targets[0]] for r in (0, 1, 3)} == {(0, 3), (1, 3), (2, 3)}

    mixed = [*sources[:3], SourceMeta(3, 0)]
    with pytest.raises(P2PError, match="disagree on their export"):
        assign(mixed, args, infos, layouts, generation=3)

"""Several senders per rollout rank (issue 18): when a stage has more trainer ranks than there are targets, each
target's parameters are split over k of them (`build_transfer_plan`, `split_by_bytes`), and every one writes its
part concurrently over its own Mooncake endpoint.

Tiny Qwen3-MoE (id-encoded float32), one engine TP2/EP2 (two receiver processes prefilled with 0xFF, NaN in
float32), the compiled executor prepared before the push (`prepare_push`), real Mooncake tcp. Two and three
sources per target: bit-exact against SGLang's loader, every byte once, no byte twice. One source dying
mid-push: its target is named, re-pushed alone by the survivors, exact."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from verl_p2p.errors import TransferError
from verl_p2p.planning.plan import SourceRank, build_transfer_plan
from verl_p2p.planning.targets import TargetRank
from verl_p2p.trainer.push import PushTarget, push
from verl_p2p.transfer.buffers import TransferBuffers
from verl_p2p.transfer.mooncake import MooncakeTransport
from verl_p2p.transfer.receiver import FILL_BYTE, spec_from_plan, start_receivers, stop_all
from verl_p2p.transfer.writer import Writer

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytestmark = pytest.mark.slow

SERVER_ARGS = {"tp_size": 2, "ep_size": 2, "dtype": "float32"}
TARGETS = [TargetRank(0, 0), TargetRank(0, 1)]
SLOT_BYTES = 24 * 1024  # < the largest parameter: chunked loads
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def model():
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica.stream import RankReplica
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.sandbox.tiny import tiny_config_dict, tiny_state_dict

    install_cpu_stubs()
    cfg = tiny_config_dict("qwen3_moe")
    hf = tiny_state_dict(cfg, id_encoded=True)
    specs = {n: (tuple(t.shape), t.dtype) for n, t in hf.items()}
    replicas = {
        t: RankReplica.build(cfg, SERVER_ARGS, layout_from_server_args(SERVER_ARGS, t.rank), specs) for t in TARGETS
    }
    expected = {}
    for t, rep in replicas.items():  # what SGLang's loader puts in that rank's memory
        expected[t] = {}
        for name, p in rep.plan.params.items():
            want = torch.full((p.nbytes,), FILL_BYTE, dtype=torch.uint8)
            rep.load(name, {f: hf[f] for f in p.feeds}, want)
            expected[t][name] = want
    return hf, replicas, expected


@pytest.fixture(scope="module")
def receivers(model):
    _, replicas, _ = model
    handles = start_receivers({f"{t.engine}.{t.rank}": spec_from_plan(replicas[t].plan.params) for t in TARGETS})
    yield {t: handles[f"{t.engine}.{t.rank}"] for t in TARGETS}
    stop_all(handles.values())


@pytest.fixture(scope="module")
def transports():
    return [MooncakeTransport("127.0.0.1", protocol="tcp", timeout_s=TIMEOUT_S) for _ in range(6)]


class DiesMidPush:
    """A source's Mooncake endpoint that stops for good on its second write call (its process gone): the
    first call's bytes landed, nothing after."""

    def __init__(self, inner: MooncakeTransport) -> None:
        self.inner, self.calls, self.written = inner, 0, 0

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, addr: int, nbytes: int) -> None:
        self.inner.register(addr, nbytes)

    def unregister(self, addr: int) -> None:
        self.inner.unregister(addr)

    def write(self, session_id, local_addrs, remote_addrs, lengths) -> None:
        self.calls += 1
        if self.calls > 1:
            raise TransferError(f"source endpoint {self.inner.session_id} is gone")
        self.inner.write(session_id, local_addrs, remote_addrs, lengths)
        self.written += sum(lengths)


def push_all(plan, sources, transports, model, receivers):
    """Every source of `plan` pushes its targets' parts at once (threads, one endpoint each); per-source results."""
    from verl_p2p.replica.compiled import CompiledReplica

    hf, replicas, _ = model
    results: dict[int, object] = {}

    def source(rank: int) -> None:
        mine = []
        for t in plan.targets_of(rank):
            executor = CompiledReplica(replicas[t])  # each source its own executor, prepared before the push
            executor.prepare_push(SLOT_BYTES)
            mine.append(PushTarget(t, executor, receivers[t].remote_info(), plan.part_of(rank, t)))
        if not mine:
            return
        transport = transports[rank]
        buffers = TransferBuffers(SLOT_BYTES, transport)
        writer = Writer(transport, {t.target: t.remote for t in mine}, timeout_s=TIMEOUT_S, num_workers=2)
        try:
            results[rank] = push(iter(hf.items()), mine, buffers, writer)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            results[rank] = exc
        finally:
            writer.close()
            buffers.release(settle_timeout_s=0.0)

    threads = [threading.Thread(target=source, args=(s.global_rank,)) for s in sources]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    return results


def assert_exact(tmp_path, model, receivers, tag: str) -> None:
    _, _, expected = model
    for t in TARGETS:
        got = receivers[t].dump(str(tmp_path / f"{tag}{t.rank}.pt"))
        assert set(got) == set(expected[t])
        for name, want in expected[t].items():
            assert torch.equal(got[name], want), f"{t} {name}: bytes differ from SGLang's loader"
            assert not bool(got[name].view(torch.float32).isnan().any()), f"{t} {name}: unwritten bytes"


@pytest.mark.parametrize("per_target", [2, 3])
def test_several_sources_write_disjoint_parts_of_each_rank_exactly(tmp_path, model, receivers, transports, per_target):
    _, replicas, _ = model
    for h in receivers.values():
        h.fill()
    sources = [SourceRank(r, 0) for r in range(per_target * len(TARGETS))]  # DP copies of one stage
    plan = build_transfer_plan(sources, TARGETS)
    assert plan.senders() == [s.global_rank for s in sources]
    results = push_all(plan, sources, transports, model, receivers)
    assert all(not isinstance(r, BaseException) for r in results.values()), results
    for t in TARGETS:
        writers = plan.sources_of(t)
        assert len(writers) == per_target
        per_source = [results[r].bytes_per_target[t] for r in writers]
        assert all(n > 0 for n in per_source), f"{t}: a source wrote nothing: {per_source}"
        assert sum(per_source) == replicas[t].plan.nbytes, f"{t}: {per_source} vs {replicas[t].plan.nbytes}"
        assert max(per_source) - min(per_source) <= max(p.nbytes for p in replicas[t].plan.params.values())
    assert_exact(tmp_path, model, receivers, f"split{per_target}")


def test_a_source_dying_mid_push_leaves_only_its_target_unknown_and_the_survivors_rewrite_it(
    tmp_path, model, receivers, transports
):
    _, replicas, _ = model
    for h in receivers.values():
        h.fill()
    sources = [SourceRank(r, 0) for r in range(4)]  # two sources per target
    plan = build_transfer_plan(sources, TARGETS)
    dead = 1
    dying = DiesMidPush(transports[dead])
    endpoints = list(transports)
    endpoints[dead] = dying
    results = push_all(plan, sources, endpoints, model, receivers)
    assert dying.written > 0, "the source died before writing anything: not mid-push"
    error = results[dead]
    assert isinstance(error, TransferError) and set(error.unknown_targets) == {TargetRank(0, 1)}
    assert plan.left_unknown([dead]) == [TargetRank(0, 1)]  # named from the plan too (a vanished process)
    assert all(not isinstance(results[r], BaseException) for r in (0, 2, 3))
    untouched = receivers[TargetRank(0, 0)].digest()

    survivors = [s for s in sources if s.global_rank != dead]
    retry = build_transfer_plan(survivors, plan.left_unknown([dead]))  # only the unknown target, re-split
    assert {t for s in survivors for t in retry.targets_of(s.global_rank)} == {TargetRank(0, 1)}
    again = push_all(retry, survivors, transports, model, receivers)
    assert all(not isinstance(r, BaseException) for r in again.values()), again
    assert sum(r.bytes_per_target[TargetRank(0, 1)] for r in again.values()) == replicas[TargetRank(0, 1)].plan.nbytes
    assert receivers[TargetRank(0, 0)].digest() == untouched  # the finished target was not rewritten
    assert_exact(tmp_path, model, receivers, "repushed")

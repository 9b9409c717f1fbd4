"""Several senders per rollout rank (issue 18): when a stage has more trainer ranks than there are targets, each
target's parameters are split over k of them (`build_transfer_plan`, `split_by_bytes`), and every one writes its
part concurrently over its own Mooncake endpoint.

Tiny Qwen3-MoE (id-encoded float32), one engine TP2/EP2 (two receiver processes prefilled with 0xFF, NaN in
float32), the compiled executor prepared before the push (`prepare_push`), real Mooncake tcp. The parts are the
driver's (`topology.assign` splits each target's published parameters and ships the names in the Assignment).
Two and three sources per target: bit-exact against SGLang's loader, every byte once, no byte twice. One source
dying mid-push: the manager's own outcome collection names its target, the manager's own re-plan of the re-push
gives the dead source nothing, and the survivors' re-push is exact.

Stand-ins (named as such): verl's actor worker group (a recorder of the assignments the manager sends) and the
sync lifecycle (the manager's `_ensure_plan` reads only its `sessionless_engines`)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from verl_p2p.backend.topology import Assignment, SourceMeta, assign
from verl_p2p.errors import PushError, TransferError
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.planning.targets import TargetRank
from verl_p2p.trainer.push import PushTarget, push
from verl_p2p.transfer.base import TransportProxy
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


class DiesMidPush(TransportProxy):
    """A source's Mooncake endpoint that stops for good on its second write call (its process gone): the
    first call's bytes landed, nothing after."""

    def __init__(self, inner: MooncakeTransport) -> None:
        self.inner, self.calls, self.written = inner, 0, 0

    def write(self, session_id, local_addrs, remote_addrs, lengths) -> None:
        self.calls += 1
        if self.calls > 1:
            raise TransferError(f"source endpoint {self.inner.session_id} is gone")
        self.inner.write(session_id, local_addrs, remote_addrs, lengths)
        self.written += sum(lengths)


def driver_assignments(sources, receivers, generation=1, exclude=()) -> dict[int, Assignment]:
    """What the driver hands the trainer ranks for these receivers (its own split of the published params)."""
    infos = {t: receivers[t].remote_info() for t in TARGETS}
    layouts = {t: layout_from_server_args(SERVER_ARGS, t.rank) for t in TARGETS}
    return assign(sources, {0: SERVER_ARGS}, infos, layouts, generation, exclude=exclude)


def writers_of(assignments, target) -> list[int]:
    return sorted(r for r, a in assignments.items() if target in a.targets)


def push_all(assignments, transports, model, receivers):
    """Every source with targets pushes its parts at once (threads, one endpoint each); per-source results."""
    from verl_p2p.replica.compiled import CompiledReplica

    hf, replicas, _ = model
    results: dict[int, object] = {}

    def source(rank: int) -> None:
        a = assignments[rank]
        mine = []
        for t in a.targets:
            executor = CompiledReplica(replicas[t])  # each source its own executor, prepared before the push
            executor.prepare_push(SLOT_BYTES)
            part = a.parts.get(t, (0, 1))
            mine.append(PushTarget(t, executor, a.rank_infos[t], part, a.part_names.get(t)))
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

    threads = [threading.Thread(target=source, args=(r,)) for r, a in assignments.items() if a.targets]
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
    sources = [SourceMeta(r, 0) for r in range(per_target * len(TARGETS))]  # DP copies of one stage
    assignments = driver_assignments(sources, receivers)
    assert all(a.is_source for a in assignments.values())
    results = push_all(assignments, transports, model, receivers)
    assert all(not isinstance(r, BaseException) for r in results.values()), results
    for t in TARGETS:
        writers = writers_of(assignments, t)
        assert len(writers) == per_target
        per_source = [results[r].bytes_per_target[t] for r in writers]
        assert all(n > 0 for n in per_source), f"{t}: a source wrote nothing: {per_source}"
        assert sum(per_source) == replicas[t].plan.nbytes, f"{t}: {per_source} vs {replicas[t].plan.nbytes}"
        assert max(per_source) - min(per_source) <= max(p.nbytes for p in replicas[t].plan.params.values())
    assert_exact(tmp_path, model, receivers, f"split{per_target}")


class AssignmentRecorder:
    """Stand-in for verl's actor worker group: answers `prepare` as p2p trainer ranks of one stage and records
    each `init_process_group` round's assignments (worker-group order)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rounds: list[list[Assignment]] = []

    def execute_checkpoint_engine(self, method, **kwargs):
        if method[0] == "prepare":
            return [{"p2p": "trainer", "source": SourceMeta(r, 0)} for r in range(self.world_size)]
        self.rounds.append(list(kwargs["assignment"]))
        return [None] * self.world_size


class LifecycleStandIn:
    """Stand-in for the SyncLifecycle: the one question `_ensure_plan` asks it."""

    def sessionless_engines(self) -> tuple[int, ...]:
        return ()


def connection(receivers, targets, generation, partial):
    from verl_p2p.rollout.lifecycle import Connection

    return Connection(
        generation=generation,
        server_infos={0: SERVER_ARGS},
        rank_infos={t: receivers[t].remote_info() for t in targets},
        layouts={t: layout_from_server_args(SERVER_ARGS, t.rank) for t in targets},
        partial=partial,
    )


def test_a_source_dying_mid_push_leaves_only_its_target_unknown_and_the_survivors_rewrite_it(
    tmp_path, model, receivers, transports
):
    """Driven through the manager's own retry path: `_ensure_plan` plans the push, `_push_outcomes` collects the
    sources' outcomes, `_ensure_plan` of the partial connection plans the re-push (before the fix it gave the
    dead source a part of the unknown target again)."""
    from verl.workers.config import CheckpointEngineConfig

    from verl_p2p.backend.manager import P2PCheckpointEngineManager

    _, replicas, _ = model
    for h in receivers.values():
        h.fill()
    group = AssignmentRecorder(world_size=4)  # two sources per target
    manager = P2PCheckpointEngineManager(
        CheckpointEngineConfig(backend="p2p", engine_kwargs={"p2p": {}}), actor_wg=group, replicas=[]
    )
    manager._lifecycle = LifecycleStandIn()
    asyncio.run(manager._ensure_plan(connection(receivers, TARGETS, 1, partial=False), in_pause=False))
    first = {a.rank: a for a in group.rounds[-1]}
    dead = 1
    assert first[dead].targets == (TargetRank(0, 1),) and first[dead].parts[TargetRank(0, 1)][1] == 2
    dying = DiesMidPush(transports[dead])
    endpoints = list(transports)
    endpoints[dead] = dying
    results = push_all(first, endpoints, model, receivers)
    assert dying.written > 0, "the source died before writing anything: not mid-push"
    assert all(not isinstance(results[r], BaseException) for r in (0, 2, 3))

    async def outcome(rank):
        if isinstance(results[rank], BaseException):
            raise results[rank]
        return {}

    with pytest.raises(PushError) as info:
        asyncio.run(manager._push_outcomes([outcome(r) for r in range(4)], connection(receivers, TARGETS, 1, False)))
    assert set(info.value.unknown_targets) == {TargetRank(0, 1)} and "trainer rank 1" in str(info.value)
    untouched = receivers[TargetRank(0, 0)].digest()

    asyncio.run(manager._ensure_plan(connection(receivers, [TargetRank(0, 1)], 2, partial=True), in_pause=True))
    retry = {a.rank: a for a in group.rounds[-1]}
    assert retry[dead].targets == (), f"the re-push gives the failed source {retry[dead].targets} again"
    assert writers_of(retry, TargetRank(0, 1)) == [0, 2, 3]  # the survivors split the unknown target
    again = push_all(retry, transports, model, receivers)
    assert all(not isinstance(r, BaseException) for r in again.values()), again
    assert sum(r.bytes_per_target[TargetRank(0, 1)] for r in again.values()) == replicas[TargetRank(0, 1)].plan.nbytes
    assert receivers[TargetRank(0, 0)].digest() == untouched  # the finished target was not rewritten
    assert_exact(tmp_path, model, receivers, "repushed")

"""The data plane end to end: HF stream -> real RankReplica (SGLang's model classes; SGLang's loader or the
compiled executor) -> transfer slots -> real Mooncake tcp writes into receiver processes holding each
rollout rank's parameters.

Tiny Qwen3-MoE (id-encoded float32), two engines (TP2/EP2 and TP2/EP1) x two ranks, two trainer sources
pushing concurrently per `build_transfer_plan`, slots smaller than the largest parameter (chunked loads).
Expected bytes: each rank as SGLang itself builds and loads it (`loopback.sglang_rank`, real gloo world).
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from support import replica_harness as harness

from verl_p2p.errors import RemoteMismatchError
from verl_p2p.planning.plan import SourceRank, build_transfer_plan
from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo, TargetRank
from verl_p2p.trainer.push import IncompletePushError, PushTarget, push
from verl_p2p.transfer.buffers import TransferBuffers
from verl_p2p.transfer.mooncake import MooncakeTransport
from verl_p2p.transfer.receiver import FILL_BYTE, spec_from_plan, start_receivers, stop_all
from verl_p2p.transfer.writer import Writer

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytestmark = pytest.mark.slow

ENGINES = {0: {"tp_size": 2, "ep_size": 2, "dtype": "float32"}, 1: {"tp_size": 2, "ep_size": 1, "dtype": "float32"}}
SLOT_BYTES = 24 * 1024  # < the 64 KiB w13_weight of a rank: forces chunked loads
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The checkpoint both sides load; the HF stream is its tensors, in checkpoint order."""
    from safetensors.torch import load_file

    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.sandbox.tiny import hf_tensor_shapes, write_tiny_checkpoint

    install_cpu_stubs()
    root = tmp_path_factory.mktemp("push_e2e")
    path = write_tiny_checkpoint(root / "ckpt", "qwen3_moe")
    cfg = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    hf = {n: tensors[n] for n, _ in hf_tensor_shapes(cfg)}
    specs = {n: (tuple(t.shape), t.dtype) for n, t in hf.items()}
    return cfg, specs, hf, path, root


@pytest.fixture(scope="module", autouse=True)
def witness_run(model):
    """SGLang's own ranks (real gloo world of 2, SGLang's loader) for both layouts: the expected bytes."""
    _, _, _, path, root = model
    jobs = [{"tag": f"e{e}", "model_path": str(path), "server_args": sa} for e, sa in ENGINES.items()]
    (root / "logs").mkdir()
    spec = harness.write_spec(root / "witness.json", [(2, jobs)], root / "witness")
    procs = harness.start_witnesses("0.5.12", spec, root / "logs")
    yield procs, root
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def expected(witness_run, replicas):  # replicas: built while the witnesses run
    procs, root = witness_run
    harness.wait_all(procs, 400, "SGLang witness ranks")
    out = {}
    for t in replicas:
        params = torch.load(root / "witness" / f"e{t.engine}" / f"rank{t.rank}.pt", weights_only=True)
        out[t] = {n: p.contiguous().view(-1).view(torch.uint8) for n, p in params.items()}
    return out


@pytest.fixture(scope="module")
def replicas(model):
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica.stream import RankReplica

    cfg, specs, _, _, _ = model
    return {
        TargetRank(e, r): RankReplica.build(cfg, sa, layout_from_server_args(sa, r), specs)
        for e, sa in ENGINES.items()
        for r in range(sa["tp_size"])
    }


@pytest.fixture(scope="module")
def receivers(replicas):  # idle once started: they overlap the witnesses' SGLang imports
    handles = start_receivers({f"{t.engine}.{t.rank}": spec_from_plan(rep.plan.params) for t, rep in replicas.items()})
    yield {t: handles[f"{t.engine}.{t.rank}"] for t in replicas}
    stop_all(handles.values())


@pytest.fixture
def fresh(receivers):
    for h in receivers.values():
        h.fill()
    return receivers


@pytest.fixture(scope="module")
def transports():
    return [MooncakeTransport("127.0.0.1", protocol="tcp", timeout_s=TIMEOUT_S) for _ in range(2)]


def run_source(transport, targets, hf_items, slot_bytes=SLOT_BYTES):
    buffers = TransferBuffers(slot_bytes, transport)
    writer = Writer(transport, {t.target: t.remote for t in targets}, timeout_s=TIMEOUT_S, num_workers=4)
    try:
        return push(iter(hf_items), targets, buffers, writer)
    finally:
        writer.close()
        buffers.release()


def assert_untouched(tmp_path, receivers):
    for t, h in receivers.items():
        got = h.dump(str(tmp_path / f"u{t.engine}{t.rank}.pt"))
        assert all(bool((v == FILL_BYTE).all()) for v in got.values()), f"{t} was written"


def test_validation_refuses_mismatches_before_any_write(tmp_path, model, replicas, fresh, transports):
    _, _, hf, _, _ = model
    t = TargetRank(1, 1)
    real = fresh[t].remote_info()
    name = "model.layers.1.mlp.experts.w2_weight"
    p = real.params[name]
    forged = {
        "wrong name": {**{k: v for k, v in real.params.items() if k != name}, name + "_renamed": p},
        "short": {**real.params, name: RemoteParam(p.address, p.numel - 1, p.element_size)},
        "oversized": {**real.params, name: RemoteParam(p.address, p.numel + 64, p.element_size)},
        "element size": {**real.params, name: RemoteParam(p.address, p.numel // 2, 2 * p.element_size)},
    }
    for case, params in forged.items():
        targets = [PushTarget(x, replicas[x], fresh[x].remote_info()) for x in sorted(replicas) if x != t]
        targets.append(PushTarget(t, replicas[t], RemoteRankInfo(real.session_id, params)))
        with pytest.raises(RemoteMismatchError) as err:
            run_source(transports[0], targets, list(hf.items()))
        msg = str(err.value)
        assert f"engine 1 rank 1 (session {real.session_id})" in msg and repr(name) in msg, case
        assert "nothing was written" in msg and "Likely fix" in msg, case
    assert_untouched(tmp_path, fresh)


def test_stream_missing_tensors_is_named(tmp_path, model, replicas, fresh, transports):
    _, _, hf, _, _ = model
    lost = "model.layers.1.mlp.experts.6.down_proj.weight"  # an expert of EP rank 1 (of 2)
    targets = [PushTarget(t, replicas[t], fresh[t].remote_info()) for t in (TargetRank(0, 0), TargetRank(0, 1))]
    with pytest.raises(IncompletePushError) as err:
        run_source(transports[0], targets, [(n, v) for n, v in hf.items() if n != lost])
    msg = str(err.value)
    assert "engine 0 rank 1" in msg and lost in msg and "w2_weight" in msg
    assert "engine 0 rank 0:" not in msg  # EP rank 0 got everything it needs


@pytest.mark.parametrize("executor", ["sglang", "compiled"])
def test_two_sources_write_every_rank_exactly(tmp_path, request, model, replicas, fresh, transports, executor):
    """Both executors: SGLang's loader per parameter, and the compiled copy programs (first push verified)."""
    from verl_p2p.replica.compiled import make_executor

    _, _, hf, _, _ = model
    targets = sorted(replicas)
    executors = {t: make_executor(replicas[t], executor, verify_first_push=True) for t in targets}
    sources = [SourceRank(0, 0), SourceRank(1, 0)]
    plan = build_transfer_plan(sources, targets, {t: replicas[t].key for t in targets})
    assert all(len(plan.targets_of(s.global_rank)) == 2 for s in sources)
    results, errors = {}, []

    def source(i: int) -> None:
        mine = [PushTarget(t, executors[t], fresh[t].remote_info()) for t in plan.targets_of(i)]
        try:
            results[i] = run_source(transports[i], mine, list(hf.items()))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=source, args=(s.global_rank,)) for s in sources]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    for i, metrics in results.items():
        for t in plan.targets_of(i):
            assert metrics.bytes_per_target[t] == replicas[t].plan.nbytes  # each byte written once
        assert metrics.num_batches > 2 and metrics.loaded_bytes == metrics.total_bytes  # distinct keys
    if executor == "compiled":  # every parameter compiled, and checked against SGLang's loader on this push
        assert all(not e.fallbacks and not e.verifying for e in executors.values())
    expected = request.getfixturevalue("expected")  # waits for the witnesses only now
    for t in targets:
        got = fresh[t].dump(str(tmp_path / f"{t.engine}{t.rank}.pt"))
        want = expected[t]  # what SGLang's own rank holds after loading the checkpoint
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name], want[name]), f"{t} {name}: bytes differ from SGLang's rank"
            assert not bool(got[name].view(torch.float32).isnan().any()), f"{t} {name}: unwritten bytes"


def _pp_stage_of(hf_name: str) -> int:
    """A PP=2 trainer's split of the tiny model: embed + layer 0 on stage 0, layer 1 + norm + lm_head on stage 1."""
    if hf_name.startswith("model.embed_tokens") or hf_name.startswith("model.layers.0."):
        return 0
    return 1


def test_pp_stages_each_write_their_share_of_every_rank(tmp_path, request, model, replicas, fresh, transports):
    """PP > 1: each target has one sender per stage; each stage streams only its tensors and writes only the
    parameters they feed. Together the two stages write every byte of every rank exactly once."""
    from verl_p2p.trainer.push import StageShare

    _, _, hf, _, _ = model
    targets = sorted(replicas)
    results, errors = {}, []

    def stage(s: int) -> None:
        share = StageShare(owns=lambda n: _pp_stage_of(n) == s, writes_feedless=s == 0)
        mine = [PushTarget(t, replicas[t], fresh[t].remote_info()) for t in targets]
        stream = [(n, v) for n, v in hf.items() if _pp_stage_of(n) == s]
        try:
            buffers = TransferBuffers(SLOT_BYTES, transports[s])
            writer = Writer(transports[s], {t.target: t.remote for t in mine}, timeout_s=TIMEOUT_S, num_workers=4)
            try:
                results[s] = push(iter(stream), mine, buffers, writer, share=share)
            finally:
                writer.close()
                buffers.release()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=stage, args=(s,)) for s in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    for t in targets:
        assert results[0].bytes_per_target[t] > 0 and results[1].bytes_per_target[t] > 0
        assert results[0].bytes_per_target[t] + results[1].bytes_per_target[t] == replicas[t].plan.nbytes
    expected = request.getfixturevalue("expected")
    for t in targets:
        got = fresh[t].dump(str(tmp_path / f"pp{t.engine}{t.rank}.pt"))
        for name, want in expected[t].items():
            assert torch.equal(got[name], want), f"{t} {name}: bytes differ from SGLang's rank"


def test_stage_share_refuses_a_parameter_split_across_stages(replicas):
    from verl_p2p.errors import UnsupportedLayoutError
    from verl_p2p.trainer.push import StageShare

    replica = replicas[TargetRank(0, 0)]
    split = StageShare(owns=lambda n: not n.endswith("k_proj.weight"), writes_feedless=True)  # q/v here, k elsewhere
    with pytest.raises(UnsupportedLayoutError, match="qkv_proj.*several pipeline stages"):
        split.select(replica.plan.params)

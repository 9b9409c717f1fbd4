"""FSDP / FSDP2 trainers as a p2p source (issue 36), on CPU.

A real FSDP2 (`fully_shard`) HF model on a gloo group of 2 CPU ranks, streamed by verl's own
`FSDPEngineWithLMHead.get_per_tensor_param()` (the engine instance and verl's CUDA platform lookups are named
stand-ins: tests/support/fsdp_ranks.py), found through verl's worker classes by `find_training_engine`, planned
with every rank writing its byte-balanced part of every target (`build_full_stream_plan`), and written with real
Mooncake tcp writes into receiver processes (stand-ins for the rollout ranks' weight memory, prefilled with 0xFF:
NaN in float32) of two engines: TP2/EP2 and TP1. Every byte must equal what SGLang's own loader puts in that
rank's memory from the checkpoint, for Qwen3 and Qwen3-MoE (whose packed experts verl unfuses in its stream).
Then: a rank whose endpoint dies mid-stream leaves its targets named unknown and the other rank re-pushes them,
exact; ranks streaming different models are refused by the go/no-go before a byte is written.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from support import replica_harness as harness
from support.fsdp_ranks import RankJob, run_rank

from verl_p2p.planning.targets import TargetRank
from verl_p2p.sandbox import forked
from verl_p2p.transfer.receiver import spec_from_plan, start_receivers, stop_all

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytestmark = pytest.mark.slow

SERVER_ARGS = {0: {"tp_size": 2, "ep_size": 2, "dtype": "float32"}, 1: {"tp_size": 1, "dtype": "float32"}}
TARGETS = [TargetRank(0, 0), TargetRank(0, 1), TargetRank(1, 0)]
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rollout:
    """Receivers for TARGETS, and what SGLang's own ranks hold after loading the checkpoint (witness processes:
    real gloo worlds of 2 and 1 building SGLang's model classes with SGLang's loader), started at once."""

    def __init__(self, model_dir, root, server_args: dict = SERVER_ARGS) -> None:
        from verl_p2p.planning.layout import layout_from_server_args
        from verl_p2p.replica.stream import RankReplica
        from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
        from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint

        install_cpu_stubs()
        self.root, self.server_args = root, server_args
        jobs = {e: {"tag": f"e{e}", "model_path": str(model_dir), "server_args": sa} for e, sa in server_args.items()}
        (root / "logs").mkdir()
        spec = harness.write_spec(root / "witness.json", [(2, [jobs[0]]), (1, [jobs[1]])], root / "witness")
        self.witnesses = harness.start_witnesses("0.5.12", spec, root / "logs")
        cfg = json.loads((model_dir / "config.json").read_text())
        specs = hf_specs_from_checkpoint(model_dir)
        self.replicas = {
            t: RankReplica.build(
                cfg, server_args[t.engine], layout_from_server_args(server_args[t.engine], t.rank), specs
            )
            for t in TARGETS
        }
        handles = start_receivers(
            {f"{t.engine}.{t.rank}": spec_from_plan(self.replicas[t].plan.params) for t in TARGETS}
        )
        self.receivers = {t: handles[f"{t.engine}.{t.rank}"] for t in TARGETS}
        self._expected = None

    def infos(self):
        return {t: h.remote_info() for t, h in self.receivers.items()}

    def expected(self) -> dict:
        if self._expected is None:
            harness.wait_all(self.witnesses, 600, "SGLang witness ranks")
            self._expected = {}
            for t in TARGETS:
                params = torch.load(self.root / "witness" / f"e{t.engine}" / f"rank{t.rank}.pt", weights_only=True)
                self._expected[t] = {n: (p.contiguous().view(-1).view(torch.uint8), p.dtype) for n, p in params.items()}
        return self._expected

    def assert_exact(self, tmp_path, tag: str) -> None:
        self.assert_equal(self.dump(tmp_path, tag))

    def dump(self, tmp_path, tag: str) -> dict:
        """What every target's receiver holds now: {target: {name: uint8 tensor}}."""
        return {t: self.receivers[t].dump(str(tmp_path / f"{tag}{t.engine}.{t.rank}.pt")) for t in TARGETS}

    def assert_equal(self, dumps: dict) -> None:
        for t in TARGETS:
            got = dumps[t]
            want = self.expected()[t]  # what SGLang's own rank holds after loading the checkpoint
            assert set(got) == set(want)
            for name, (data, dtype) in want.items():
                assert not bool(got[name].view(dtype).isnan().any()), f"{t} {name}: unwritten bytes"
                assert torch.equal(got[name], data), f"{t} {name}: bytes differ from SGLang's rank"

    def close(self) -> None:
        stop_all(self.receivers.values())
        for p in self.witnesses:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_ranks(model_dir, rollout: Rollout, **job_args) -> dict[int, dict]:
    """WORLD FSDP ranks in processes forked from a preloaded template (sandbox/forked.py); {rank: results}.
    `job_args`: per-rank RankJob fields."""
    queue = forked.context().Queue()
    port, infos = _free_port(), rollout.infos()
    procs = []
    for rank in range(WORLD):
        fields = {k: (v(rank) if callable(v) else v) for k, v in job_args.items()}
        job = RankJob(rank, WORLD, port, str(model_dir), rollout.server_args, infos, **fields)
        procs.append(forked.process(run_rank, (job, queue), daemon=True))
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    errors = {rank: r["error"] for rank, r in results.items() if "error" in r}
    assert not errors, "\n".join(f"rank {rank}: {e}" for rank, e in sorted(errors.items()))
    return results


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def model(request, tmp_path_factory):
    from verl_p2p.sandbox.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp(request.param)
    tied = {"tie_word_embeddings": True} if request.param == "qwen3" else {}  # as Qwen3-4B: verl streams lm_head
    model_dir = write_tiny_checkpoint(root / "ckpt", request.param, id_encoded=True, **tied)
    rollout = Rollout(model_dir, root)
    yield model_dir, rollout
    rollout.close()


def test_fsdp2_stream_from_every_rank_is_bit_exact_in_tp2_ep2_and_tp1_engines(tmp_path, model):
    model_dir, rollout = model
    for h in rollout.receivers.values():
        h.fill()
    results = run_ranks(model_dir, rollout)
    for rank, r in results.items():
        assert r["sync"]["mode"] == "full_stream"
        assert r["sync"]["stream_is_manifest"] is True  # the pre-launch checks saw what verl then streamed
        parts = {part for part in r["sync"]["parts"].values()}
        assert parts == {(rank, WORLD)}, f"rank {rank} writes {parts}, not its part of every target"
    for t in TARGETS:
        per_rank = [results[r]["sync"]["bytes_per_target"][str(t)] for r in range(WORLD)]
        assert all(n > 0 for n in per_rank), f"{t}: a rank wrote nothing: {per_rank}"
        assert sum(per_rank) == rollout.replicas[t].plan.nbytes, f"{t}: {per_rank}: bytes missing or twice"
    rollout.assert_exact(tmp_path, "fsdp")


@pytest.mark.parametrize("param_offload", [False, True], ids=["", "param_offload"])
def test_fsdp1_stream_from_every_rank_is_bit_exact_like_fsdp2(tmp_path, model, param_offload):
    """verl's `actor.strategy=fsdp`: torch's FullyShardedDataParallel as verl wraps it (tests/support/fsdp_ranks.py
    `fsdp1_engine`), streamed by the same `get_per_tensor_param()` after verl's FSDP1 staging; with
    `param_offload`, through verl's and p2p's staging around the state dict (a host-to-host move on this CPU host)."""
    model_dir, rollout = model
    for h in rollout.receivers.values():
        h.fill()
    results = run_ranks(model_dir, rollout, strategy="fsdp", param_offload=param_offload)
    for rank, r in results.items():
        assert r["sync"]["stream_is_manifest"] is True, f"rank {rank}: the FSDP1 stream is not the predicted one"
    for t in TARGETS:
        per_rank = [results[r]["sync"]["bytes_per_target"][str(t)] for r in range(WORLD)]
        assert sum(per_rank) == rollout.replicas[t].plan.nbytes and all(per_rank), f"{t}: {per_rank}"
    rollout.assert_exact(tmp_path, "fsdp1")


@pytest.mark.parametrize("model", ["qwen3_moe"], indirect=True)  # the drill once: the stream is the same code
def test_a_rank_dying_mid_stream_leaves_its_targets_unknown_and_the_other_rank_repushes_them(tmp_path, model):
    model_dir, rollout = model
    for h in rollout.receivers.values():
        h.fill()
    dead = 1
    results = run_ranks(model_dir, rollout, dies_after_writes=lambda r: 1 if r == dead else 0, repush=True)
    first = results[dead]["sync"]
    assert "gone" in first["failed"], first
    unknown = {TargetRank(*t) for t in results[0]["sync"]["unknown"]}
    assert unknown == set(TARGETS)  # its part of every target: every target is unknown
    assert results[0]["sync"]["dead"] == [dead]
    again = results[0]["repush"]
    assert again["parts"] == {str(t): (0, 1) for t in TARGETS}  # the survivor writes every target whole
    for t in TARGETS:
        assert again["bytes_per_target"][str(t)] == rollout.replicas[t].plan.nbytes
    assert results[dead]["repush"]["bytes_per_target"] == {}  # it only ran the stream's gathers
    rollout.assert_exact(tmp_path, "repushed")

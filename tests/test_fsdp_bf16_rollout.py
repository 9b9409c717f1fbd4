"""An fp32-master FSDP actor synced into bf16 rollouts through verl's own worker, on CPU (issue 40, R32).

verl's FSDP actor keeps fp32 master weights (its default mixed precision) while the rollout serves bf16, so every
sync narrows fp32 to bf16 on the way. The trainer here is the real FSDP2 (`fully_shard`) model, and for the dense
model also FSDP1 (`FullyShardedDataParallel`, verl's `actor.strategy=fsdp`), of tests/support/fsdp_ranks.py on 2
gloo ranks, holding fp32 weights that differ from the rollout's starting checkpoint in every bf16 byte and carry
random low mantissa bits (so a cast that truncates instead of rounding to nearest, or a stale byte anywhere, shows).
Each sync runs as verl runs it: `ActorRolloutRefWorker.update_weights` calls the engine's `get_per_tensor_param()`
and hands the generator to p2p's `send_weights`.

- Every byte of the TP2 and TP1 bf16 rollout ranks equals what SGLang's own loader puts there from the same fp32
  HF weights (witness processes: tests/test_fsdp_source.py's `Rollout`).
- One stream per sync: verl's `get_per_tensor_param()` runs once per sync (p2p consumes the generator verl handed
  it), and each DTensor of the state dict is gathered once.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_fsdp_source import TARGETS, WORLD, Rollout, run_ranks

pytestmark = pytest.mark.slow

BF16_ARGS = {0: {"tp_size": 2, "dtype": "bfloat16"}, 1: {"tp_size": 1, "dtype": "bfloat16"}}
SYNCS = 2


def trained_weights(start: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """fp32 weights whose bf16 rounding differs from `start`'s bf16 in both bytes of every element: the sign bit
    and the exponent's lowest bit flip (a finite value of the same magnitude range), the low mantissa bit is cleared
    so rounding up cannot carry into the flipped bits, and the 16 bits below bf16's mantissa are random (round to
    nearest goes down or up, ties included)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in start.items():
        bits = t.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        high, low = (bits >> 8) ^ 0x80, ((bits & 0xFF) ^ 0x80) & 0xFE
        noise = torch.randint(0, 1 << 16, bits.shape, generator=gen, dtype=torch.int64)
        word = (high << 24) | (low << 16) | noise  # an fp32 bit pattern, as an unsigned 32-bit number
        out[name] = (word - (word >> 31) * (1 << 32)).to(torch.int32).view(torch.float32)
    return out


def bf16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).contiguous().view(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """Per model, made once: the rollout's starting checkpoint, the trained fp32 weights (the actor's and the
    witnesses' checkpoint) and the bf16 rollout: {model: (start, trained, model_dir, rollout)}."""
    made: dict = {}

    def make(arch: str):
        if arch not in made:
            made[arch] = _trained_rollout(arch, tmp_path_factory.mktemp(f"bf16-{arch}"))
        return made[arch]

    yield make
    for *_, rollout in made.values():
        rollout.close()


def _trained_rollout(arch: str, root):
    from safetensors.torch import load_file, save_file

    from verl_p2p.sandbox.tiny import write_tiny_checkpoint

    tied = {"tie_word_embeddings": True} if arch == "qwen3" else {}  # as Qwen3-4B: verl streams lm_head
    start_dir = write_tiny_checkpoint(root / "start", arch, id_encoded=False, init="model", **tied)
    start = load_file(str(start_dir / "model.safetensors"))
    weights = trained_weights(start)
    model_dir = root / "trained"
    shutil.copytree(start_dir, model_dir)
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((model_dir / "config.json").read_text())["torch_dtype"] == "float32"
    return start, weights, model_dir, Rollout(model_dir, root, server_args=BF16_ARGS)


# FSDP1 on the dense model here; tests/test_fsdp_source.py streams both models through it into fp32 rollouts
@pytest.fixture(scope="module", params=[("qwen3", "fsdp2"), ("qwen3_moe", "fsdp2"), ("qwen3", "fsdp")], ids="-".join)
def synced(request, rollouts, tmp_path_factory):
    """SYNCS syncs through verl's worker by an actor of verl's `actor.strategy`: (start, trained, rollout,
    per-rank results, what the receivers hold after)."""
    arch, strategy = request.param
    start, weights, model_dir, rollout = rollouts(arch)
    for h in rollout.receivers.values():
        h.fill()
    results = run_ranks(model_dir, rollout, verl_syncs=SYNCS, strategy=strategy)
    return start, weights, rollout, results, rollout.dump(tmp_path_factory.mktemp("dump"), strategy)


def test_fp32_master_fsdp_stream_into_bf16_rollouts_equals_sglangs_own_load(synced):
    start, trained, rollout, results, dumps = synced
    for name, t in trained.items():  # what the test can see: every bf16 byte moves, and rounding matters
        assert bool((bf16_bytes(t) != bf16_bytes(start[name])).all()), f"{name}: a bf16 byte did not change"
    rounded_up = sum(int((t.to(torch.bfloat16).float().abs() > t.abs()).sum()) for t in trained.values())
    assert rounded_up > sum(t.numel() for t in trained.values()) // 4  # truncation would differ from RNE there
    for rank, r in results.items():
        assert r["param_dtypes"] == ["torch.float32"], f"rank {rank}: the actor's master weights are not fp32"
    for m in results[0]["metrics"]:  # what verl's worker got back from send_weights, each sync
        assert any(k.endswith("/bytes") and v > 0 for k, v in m.items()), m
    rollout.assert_equal(dumps)
    for t in TARGETS:  # the rollout ranks hold bf16 parameters (the witnesses' own dtype)
        assert any(dtype == torch.bfloat16 for _, dtype in rollout.expected()[t].values()), t


def test_one_get_per_tensor_param_per_sync_consumed_from_verls_send_weights(synced):
    results = synced[3]
    for rank in range(WORLD):
        r = results[rank]
        assert r["calls"] == [1] * SYNCS, f"rank {rank}: get_per_tensor_param calls per sync {r['calls']}"
        assert r["gathers"] == [r["dtensors"]] * SYNCS, (
            f"rank {rank}: full_tensor gathers per sync {r['gathers']}, state dict has {r['dtensors']} DTensors"
        )

"""FP8 MLA (DeepSeek-V3 / Kimi-K2 style): the replica's bytes equal SGLang's own rank load of the trainer's
block-FP8 checkpoint, on a release with weight-update sessions (0.5.23), where MLA's derived tensors are rebuilt
at session end. Witness: SGLang gloo ranks loading the FP8 files `trainer/fp8_checkpoint.py` wrote from a bf16
tiny DeepSeek-V3 whose every TP shard is a multiple of 128. Replica: fed the *bf16* tensors through the trainer's
quantize step, whole and chunked, reference and compiled executor. The attention's kv-cache scales, which
SGLang's Fp8 method creates and no checkpoint tensor feeds, are the plan's rollout-local parameters."""

from __future__ import annotations

import pytest
import torch
from support import replica_matrix
from test_fp8_plan import MLA_128

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
VERSIONS = ("0.5.23",)
MLA_LAYERS = 3  # the tiny DeepSeek-V3's layers (one dense, two MoE)


MLA_FP8 = replica_matrix.Checkpoint.of("deepseek_v3", "bfloat16", False, True, torch_dtype="bfloat16", **MLA_128)
MATRIX = replica_matrix.declare(
    __name__,
    VERSIONS,
    [
        replica_matrix.Job("mla-fp8-tp2", MLA_FP8, {"dtype": "bfloat16", "tp_size": 2}),
        # Kimi-K2's 32-GPU FP8 layout in small: its 128-row-per-matrix shared expert split over 2 ranks would be 64
        # rows, which SGLang's 128-block rule refuses; kept whole (SGLANG_SHARED_EXPERT_TP1=1, and the dense MLP by
        # --moe-dense-tp-size 1) on every rank, which the replica reads from the published sizes
        replica_matrix.Job(
            "mla-fp8-tp2-ep2-sharedtp1",
            replica_matrix.Checkpoint.of(
                "deepseek_v3",
                "bfloat16",
                False,
                True,
                torch_dtype="bfloat16",
                **{**MLA_128, "moe_intermediate_size": 128},
            ),
            {"dtype": "bfloat16", "tp_size": 2, "ep_size": 2, "moe_dense_tp_size": 1},
            env={"SGLANG_SHARED_EXPERT_TP1": "1"},
            options={"shared_tp1_from_published": True},
        ),
    ],
)


@pytest.fixture(scope="module")
def mla_fp8(request, replica_witnesses):
    """Built once per release for the session with the other replica modules' jobs: tests/support/replica_matrix.py."""
    return replica_witnesses(request, MATRIX)


def test_fp8_mla_replica_bytes_equal_sglang_ranks(mla_fp8):
    r = mla_fp8.result("0.5.23", "mla-fp8-tp2")
    witness = torch.load(mla_fp8.witness_dir("0.5.23", "mla-fp8-tp2") / "rank1.pt")
    assert r["version"].startswith("0.5.23")
    assert not r["problems"], r["problems"]
    assert r["checked"] > 0 and r["compiled"] == r["checked"]
    assert not r["fallbacks"], r["fallbacks"]
    for rank in ("0", "1"):  # SGLang's kv-cache scales: local, never written; MLA's derived tensors listed
        assert r["local"][rank] and all(n.endswith(("k_scale", "v_scale")) for n in r["local"][rank])
        # what the witness's post_load_weights built from the FP8 kv_b_proj (dequantized with its scales)
        built = torch.load(mla_fp8.witness_dir("0.5.23", "mla-fp8-tp2") / f"derived{rank}.pt")
        absorbed = {n for n in built if n.endswith((".w_kc", ".w_vc"))}
        layers = MLA_LAYERS
        assert absorbed == {f"model.layers.{i}.self_attn.{w}" for i in range(layers) for w in ("w_kc", "w_vc")}
        listed = set(r["derived"][rank])
        assert absorbed <= listed and all(".self_attn.w_" in n for n in listed), (listed, absorbed)
    assert witness["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert witness["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"].dtype == torch.float32


def test_fp8_shared_expert_held_whole_on_every_rank(mla_fp8):
    """The layout that lets block-FP8 Kimi-K2 run on 32-GPU engines, in small: every rank's bytes equal SGLang's
    own, its FP8 shared expert (and dense MLP) whole with their 128x128 scales, read from the published sizes;
    the replica the server info alone gives (the shared expert split to 64 rows) is refused by SGLang's rule."""
    r = mla_fp8.result("0.5.23", "mla-fp8-tp2-ep2-sharedtp1")
    assert not r["problems"], r["problems"]
    assert r["checked"] > 0 and r["compiled"] == r["checked"] and not r["fallbacks"], r["fallbacks"]
    assert r["shared_tp1"] == [True] * 2
    assert {tuple(s) for s in r["shared_shapes"]["replica"]} == {(256, 256)}  # 2 x 128 rows, whole
    assert len(r["shared_refusals"]) == 2
    assert all("not divisible by weight quantization block_n = 128" in t for t in r["shared_refusals"])
    assert all("SGLANG_SHARED_EXPERT_TP1=1 / --moe-dense-tp-size 1" in t for t in r["shared_refusals"])
    for rank in range(2):
        witness = torch.load(mla_fp8.witness_dir("0.5.23", "mla-fp8-tp2-ep2-sharedtp1") / f"rank{rank}.pt")
        shared = "model.layers.1.mlp.shared_experts.gate_up_proj"
        assert witness[f"{shared}.weight"].dtype == torch.float8_e4m3fn
        assert tuple(witness[f"{shared}.weight"].shape) == (256, 256)
        assert tuple(witness[f"{shared}.weight_scale_inv"].shape) == (2, 2)
        assert tuple(witness["model.layers.0.mlp.gate_up_proj.weight"].shape) == (1024, 256)  # dense, whole

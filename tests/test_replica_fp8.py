"""FP8 rollouts: the replica's bytes equal SGLang's own rank load of the trainer's block-FP8 checkpoint.

Witness: SGLang ranks (real gloo world, SGLang's loader, its Fp8 methods' weight creation, loaders and Hopper
post-load path) loading the FP8 checkpoint `trainer/fp8_checkpoint.py` wrote from a bf16 Qwen3-MoE. Replica:
`RankReplica` built with the checkpoint's quant config, fed the *bf16* tensors through the trainer's quantize
step (`trainer/fp8_stream.py`), every parameter (e4m3fn weights, fp32 `weight_scale_inv`, bf16 rest) loaded into
NaN-prefilled buffers, whole and chunked, by the reference and the compiled executor. The shapes make every TP
shard a multiple of 128 (SGLang's block rule). SGLang 0.5.12 and 0.5.23.
"""

from __future__ import annotations

import pytest
import torch
from support import replica_matrix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

VERSIONS = ("0.5.12", "0.5.23")
# q 512, kv 256, experts 512 wide: TP2 and TP4 shards of every block-quantized projection are multiples of 128
SHAPE = dict(hidden_size=256, head_dim=128, moe_intermediate_size=512, intermediate_size=512)
LAYOUTS = [("moe-fp8-tp2-ep2", dict(tp_size=2, ep_size=2)), ("moe-fp8-tp4", dict(tp_size=4))]


MATRIX = replica_matrix.declare(
    __name__,
    VERSIONS,
    [
        replica_matrix.Job(
            tag,
            replica_matrix.Checkpoint.of("qwen3_moe", "bfloat16", id_encoded=False, fp8=True, **SHAPE),
            {"dtype": "bfloat16", **args},
        )
        for tag, args in LAYOUTS
    ],
)


@pytest.fixture(scope="module")
def fp8_results(request, replica_witnesses):
    """Built once per release for the session with the other replica modules' jobs: tests/support/replica_matrix.py."""
    return replica_witnesses(request, MATRIX)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("tag", [t for t, _ in LAYOUTS])
def test_fp8_replica_bytes_equal_sglang_ranks(fp8_results, version, tag):
    r = fp8_results.result(version, tag)
    assert r["version"].startswith(version)
    assert not r["problems"], r["problems"]
    assert r["checked"] > 0 and r["chunked"] > 0
    assert r["compiled"] == r["checked"] and r["compiled_chunked"] == r["chunked"]
    assert not r["fallbacks"], r["fallbacks"]


def test_the_witness_holds_fp8_weights_and_block_scales(fp8_results):
    """The comparison is about FP8 bytes: SGLang's rank really holds e4m3fn weights and fp32 block scales."""
    witness = torch.load(fp8_results.witness_dir("0.5.12", "moe-fp8-tp2-ep2") / "rank1.pt")
    assert witness["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    assert witness["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].dtype == torch.float32
    # TP2 rank 1: q 256 + k 128 + v 128 rows -> 4 row blocks; 256 columns -> 2
    assert tuple(witness["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape) == (4, 2)
    assert witness["model.layers.1.mlp.experts.w13_weight"].dtype == torch.float8_e4m3fn
    assert witness["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # the router stays bf16
    assert witness["lm_head.weight"].dtype == torch.bfloat16

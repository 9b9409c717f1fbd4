"""The replica's bytes equal SGLang's own, rank by rank (docs/architecture.md: the replica).

Witness: every rank of every layout built by `build_sglang_rank_model` in a real gloo world of N processes
(SGLang's parallel init and model loader). Replica: `RankReplica` in one process, every parameter loaded
into a NaN-prefilled buffer, then again chunk by chunk; the compiled executor (`CompiledReplica`: copy
programs, no SGLang call) the same way. Id-encoded float32 checkpoints make every misplaced, missing or
doubled element visible; random bfloat16 checkpoints (a bfloat16 rollout) check the production dtype.
Run for SGLang 0.5.12, 0.5.21 and 0.5.23 (the oldest and newest supported releases and one between them), each
in its own processes.
"""

from __future__ import annotations

import pytest
from support import replica_harness as harness
from support import replica_matrix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

VERSIONS = tuple(harness.SGLANG_DIRS)

# (tag, checkpoint, server args); the world size is tp_size.
MODELS = {
    # vocab 250 pads to 256 rows (SGLang's fill), tied embeddings: lm_head is embed_tokens
    "qwen2": dict(arch="qwen2", vocab_size=250, tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3"),
    # untied lm_head with padded vocab rows
    "moe": dict(arch="qwen3_moe", vocab_size=250),
}
# checkpoint variants: (checkpoint dtype = rollout dtype, id-encoded values)
VARIANTS = {"f32ids": ("float32", True), "bf16rand": ("bfloat16", False)}
LAYOUTS = [
    ("qwen2-tp1", "qwen2", dict(tp_size=1)),
    ("qwen3-tp1", "qwen3", dict(tp_size=1)),
    ("moe-tp1", "moe", dict(tp_size=1)),
    ("qwen2-tp2", "qwen2", dict(tp_size=2)),
    ("qwen3-tp2", "qwen3", dict(tp_size=2)),
    ("moe-tp2", "moe", dict(tp_size=2)),
    ("moe-tp2-ep2", "moe", dict(tp_size=2, ep_size=2)),
    ("qwen2-tp4", "qwen2", dict(tp_size=4)),
    ("qwen3-tp4", "qwen3", dict(tp_size=4)),
    ("moe-tp4", "moe", dict(tp_size=4)),
    ("moe-tp4-ep2", "moe", dict(tp_size=4, ep_size=2)),
    ("moe-tp4-ep4", "moe", dict(tp_size=4, ep_size=4)),
    ("moe-tp4-ep2-dpattn2", "moe", dict(tp_size=4, ep_size=2, dp_size=2, enable_dp_attention=True)),
    (
        "qwen3-tp4-dpattn2-dplmhead",
        "qwen3",
        dict(tp_size=4, dp_size=2, enable_dp_attention=True, enable_dp_lm_head=True),
    ),
]


MATRIX = replica_matrix.declare(
    __name__,
    VERSIONS,
    [
        replica_matrix.Job(
            f"{tag}-{variant}",
            replica_matrix.Checkpoint.of(dtype=dtype, id_encoded=ids, **MODELS[model]),
            {"dtype": dtype, **args},
        )
        for tag, model, args in LAYOUTS
        for variant, (dtype, ids) in VARIANTS.items()
    ],
)


@pytest.fixture(scope="module")
def exact_results(request, replica_witnesses):
    """Witness dumps for every layout under every SGLang release of the matrix, then the replica comparisons.

    Built once per release for the session (tests/support/replica_matrix.py: with the other replica modules' jobs,
    one group of four witness processes per release, worlds of 4, then 2, then 1, torn down in between).
    """
    return replica_witnesses(request, MATRIX)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tag", [t for t, _, _ in LAYOUTS])
def test_replica_bytes_equal_sglang_ranks(exact_results, version, tag, variant):
    """Reference executor bytes == compiled executor bytes == SGLang's own rank, whole and chunked."""
    r = exact_results.result(version, f"{tag}-{variant}")
    assert r["version"].startswith(version)
    assert not r["problems"], r["problems"]
    assert r["checked"] > 0 and r["chunked"] > 0
    assert r["compiled"] == r["checked"] and r["compiled_chunked"] == r["chunked"]
    assert not r["fallbacks"], r["fallbacks"]  # every parameter of these layouts compiles

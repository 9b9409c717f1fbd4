"""Witnessed exact match in the common production case: a float32 trainer export into a bfloat16 rollout, and
exports that are non-contiguous views (docs/architecture.md: the replica).

Witness: SGLang's own rank load of the same float32 checkpoint into a bfloat16 model, rank by rank, in a real
gloo world (`tests/support/replica_witness.py`). Replica: the reference executor and the compiled executor,
whole and chunked, fed the checkpoint's tensors as they are and as non-contiguous views (transposed storage,
every other element of a wider tensor). Random values make every rounding visible; id-encoded float32 into a
float32 rollout makes every misplaced element visible under non-contiguous feeds. One release per test, so
`-k 0.5.12` runs one release's witnesses only.
"""

from __future__ import annotations

import pytest
from support import replica_harness as harness
from support import replica_matrix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

VERSIONS = tuple(harness.SGLANG_DIRS)
# (tag, arch, checkpoint overrides, server args); a padded, tied vocabulary and an MoE with EP among them
LAYOUTS = [
    ("qwen2-tp2", "qwen2", dict(vocab_size=250, tie_word_embeddings=True), dict(tp_size=2)),
    ("qwen3-tp1", "qwen3", {}, dict(tp_size=1)),
    ("moe-tp2-ep2", "qwen3_moe", dict(vocab_size=250), dict(tp_size=2, ep_size=2)),
]
# variant: (checkpoint dtype, id-encoded, rollout dtype)
VARIANTS = {"f32rand-to-bf16": ("float32", False, "bfloat16"), "f32ids-to-f32": ("float32", True, "float32")}


MATRIX = replica_matrix.declare(
    __name__,
    VERSIONS,
    [
        replica_matrix.Job(
            f"{tag}-{variant}",
            replica_matrix.Checkpoint.of(arch, dtype, ids, **overrides),
            {"dtype": rollout_dtype, **args},
            options={"strided_feeds": True},
        )
        for tag, arch, overrides, args in LAYOUTS
        for variant, (dtype, ids, rollout_dtype) in VARIANTS.items()
    ],
)


@pytest.fixture(scope="module")
def cast_results(request, replica_witnesses):
    """Built once per release for the session with the other replica modules' jobs (the id-encoded float32
    witnesses are test_replica_exact.py's): tests/support/replica_matrix.py."""
    return replica_witnesses(request, MATRIX)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tag", [t for t, _, _, _ in LAYOUTS])
@pytest.mark.parametrize("version", VERSIONS)
def test_casts_and_non_contiguous_feeds_equal_sglang_ranks(cast_results, version, tag, variant):
    r = cast_results.result(version, f"{tag}-{variant}")
    checkpoint_dtype, _, rollout_dtype = VARIANTS[variant]
    assert r["version"].startswith(version)
    assert r["checkpoint_dtypes"] == [f"torch.{checkpoint_dtype}"]
    assert f"torch.{rollout_dtype}" in r["rollout_dtypes"]
    assert not r["problems"], r["problems"]
    assert r["checked"] > 0 and r["compiled"] == r["checked"] and r["strided"] > 0
    assert not r["fallbacks"], r["fallbacks"]

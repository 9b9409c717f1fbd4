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
import torch
from support import replica_harness as harness
from support.replica_compare import compare_jobs

from verl_p2p.sandbox.tiny import write_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

VERSIONS = tuple(harness.SGLANG_DIRS)
# (tag, arch, checkpoint overrides, server args); a padded, tied vocabulary and an MoE with EP among them
LAYOUTS = [
    ("qwen2-tp2", "qwen2", dict(vocab_size=250, tie_word_embeddings=True), dict(tp_size=2)),
    ("qwen3-tp1", "qwen3", {}, dict(tp_size=1)),
    ("moe-tp2-ep2", "qwen3_moe", dict(vocab_size=250), dict(tp_size=2, ep_size=2)),
]
# variant: (checkpoint dtype, id-encoded, rollout dtype)
VARIANTS = {"f32rand-to-bf16": (torch.float32, False, "bfloat16"), "f32ids-to-f32": (torch.float32, True, "float32")}


@pytest.fixture(scope="module", params=VERSIONS)
def cast_results(request, tmp_path_factory):
    version = request.param
    root = tmp_path_factory.mktemp(f"casts-{version}")
    by_world: dict[int, list[dict]] = {}
    for tag, arch, overrides, args in LAYOUTS:
        for variant, (dtype, ids, rollout_dtype) in VARIANTS.items():
            path = write_tiny_checkpoint(root / f"{tag}-{variant}", arch, id_encoded=ids, dtype=dtype, **overrides)
            job = {
                "tag": f"{tag}-{variant}",
                "model_path": str(path),
                "server_args": {"dtype": rollout_dtype, **args},
                "strided_feeds": True,
            }
            by_world.setdefault(args["tp_size"], []).append(job)
    logs = root / "logs"
    logs.mkdir()
    phases = [(w, by_world[w]) for w in sorted(by_world, reverse=True)]
    spec = harness.write_spec(root / "spec.json", phases, root / "out")
    harness.wait_all(harness.start_witnesses(version, spec, logs), 900, f"SGLang {version} witnesses")
    if harness.SGLANG_DIRS[version] is None:  # the release installed in this process
        results = compare_jobs([spec])
    else:
        proc, log = harness.start_compare(version, [spec], logs)
        harness.wait_all([proc], 900, "replica comparison")
        results = harness.read_results(log)
    return version, {r["tag"]: r for r in results}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tag", [t for t, _, _, _ in LAYOUTS])
def test_casts_and_non_contiguous_feeds_equal_sglang_ranks(cast_results, tag, variant):
    version, results = cast_results
    r = results[f"{tag}-{variant}"]
    checkpoint_dtype, _, rollout_dtype = VARIANTS[variant]
    assert r["version"].startswith(version)
    assert r["checkpoint_dtypes"] == [str(checkpoint_dtype)]
    assert f"torch.{rollout_dtype}" in r["rollout_dtypes"]
    assert not r["problems"], r["problems"]
    assert r["checked"] > 0 and r["compiled"] == r["checked"] and r["strided"] > 0
    assert not r["fallbacks"], r["fallbacks"]

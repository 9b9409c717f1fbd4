"""The replica's bytes equal SGLang's own rank load for the new model classes: DeepSeek-V3, DeepSeek-V2 and
GLM-4.7-Flash (MLA, derived tensors: they need sessions), GLM-4.5 (shared-experts fusion) and Llama.

Same witness machinery as test_replica_exact.py (SGLang's parallel init and loader in real gloo worlds, its
`post_load_weights` included), for the releases with weight-update sessions only (0.5.21, 0.5.23): a class whose
`post_load_weights` derives tensors is synced only into those (older rollouts are refused, test_refusals.py).
(0.5.12, which has no sessions, is in test_replica_exact.py for the classes that need none.)
The witness also dumps the tensors SGLang derived (MLA's w_kc / w_vc), which the plan must list as allow-listed
derivations of parameters it writes. Id-encoded float32 and random bfloat16, whole and chunked, at TP1/2/4,
EP2/4 and DP attention; and a rollout that fused its shared expert, whose replica decides fusion from the
rank's published parameters.
"""

from __future__ import annotations

import pytest
import torch
from support import replica_harness as harness
from support import replica_matrix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

VERSIONS = tuple(v for v, d in harness.SGLANG_DIRS.items() if d is not None)  # releases with sessions
# 3 layers each: dense first, 8 routed + 1 shared experts, MTP layer skipped (sandbox/tiny.py: from the cards)
MODELS = {
    "dsv3": dict(arch="deepseek_v3"),  # DeepseekV3ForCausalLM (Kimi-K2's class): MLA
    "dsv2": dict(arch="deepseek_v2"),  # DeepseekV2ForCausalLM (V2-Lite: no q LoRA, 2 shared experts): MLA
    "glm45": dict(arch="glm4_moe"),  # Glm4MoeForCausalLM: GQA with qkv bias
    "glm47": dict(arch="glm4_moe_lite"),  # Glm4MoeLiteForCausalLM (GLM-4.7-Flash): MLA
    "llama": dict(arch="llama", vocab_size=250),  # LlamaForCausalLM, padded vocab rows
}
MLA = ("dsv3", "dsv2", "glm47")  # post_load_weights derives w_kc / w_vc
VARIANTS = {"f32ids": ("float32", True), "bf16rand": ("bfloat16", False)}
LAYOUTS = [
    ("dsv3-tp1", "dsv3", dict(tp_size=1)),
    ("dsv3-tp2", "dsv3", dict(tp_size=2)),
    ("dsv3-tp2-ep2", "dsv3", dict(tp_size=2, ep_size=2)),
    ("dsv3-tp4", "dsv3", dict(tp_size=4)),
    ("dsv3-tp4-ep4", "dsv3", dict(tp_size=4, ep_size=4)),
    ("dsv3-tp4-ep2-dpattn2", "dsv3", dict(tp_size=4, ep_size=2, dp_size=2, enable_dp_attention=True)),
    # a rollout that fused its shared expert into routed slot E (on a GPU it decides so itself; on CPU it is
    # told to); the replica is built from the server args without that flag and must decide from the rank's
    # published parameters, never from the trainer's device (which would not fuse here)
    ("dsv3-tp1-fused", "dsv3", dict(tp_size=1, enforce_shared_experts_fusion=True)),
    ("dsv3-tp2-fused", "dsv3", dict(tp_size=2, enforce_shared_experts_fusion=True)),
    # Kimi-K2's 32-GPU FP8 layout in small: dense MLP (--moe-dense-tp-size 1) and shared expert
    # (SGLANG_SHARED_EXPERT_TP1=1, an environment setting no /server_info reports) whole on every rank
    ("dsv3-tp4-ep4-sharedtp1", "dsv3", dict(tp_size=4, ep_size=4, moe_dense_tp_size=1)),
    ("dsv2-tp2-ep2", "dsv2", dict(tp_size=2, ep_size=2)),
    ("glm45-tp2-ep2", "glm45", dict(tp_size=2, ep_size=2)),
    ("glm45-tp4-ep2-dpattn2", "glm45", dict(tp_size=4, ep_size=2, dp_size=2, enable_dp_attention=True)),
    # GLM-4.5 fuses only where its gate sees CUDA >= sm80 (enforce_shared_experts_fusion does not override it):
    # on CPU its rollout keeps the shared expert apart, so fusion is proven for it on the GPU only
    ("glm45-tp1", "glm45", dict(tp_size=1)),
    ("glm47-tp2-ep2", "glm47", dict(tp_size=2, ep_size=2)),
    ("glm47-tp4-ep2-dpattn2", "glm47", dict(tp_size=4, ep_size=2, dp_size=2, enable_dp_attention=True)),
    ("llama-tp2", "llama", dict(tp_size=2)),
    ("llama-tp4", "llama", dict(tp_size=4)),  # 2 kv heads over 4 ranks: replicated
]
FUSED = {t for t, _, a in LAYOUTS if a.get("enforce_shared_experts_fusion")}
SHARED_TP1 = {"dsv3-tp4-ep4-sharedtp1"}  # witnesses started with SGLANG_SHARED_EXPERT_TP1=1


MATRIX = replica_matrix.declare(
    __name__,
    VERSIONS,
    [
        replica_matrix.Job(
            f"{tag}-{variant}",
            replica_matrix.Checkpoint.of(dtype=dtype, id_encoded=ids, **MODELS[model]),
            {"dtype": dtype, **args},
            env={"SGLANG_SHARED_EXPERT_TP1": "1"} if tag in SHARED_TP1 else {},
            options={"fusion_from_published": tag in FUSED, "shared_tp1_from_published": tag in SHARED_TP1},
        )
        for tag, model, args in LAYOUTS
        for variant, (dtype, ids) in VARIANTS.items()
    ],
)


@pytest.fixture(scope="module")
def exact_results(request, replica_witnesses):
    """Witness dumps for every layout under every release with sessions, then the replica comparisons (built once
    per release for the session with the other replica modules' jobs: tests/support/replica_matrix.py)."""
    return replica_witnesses(request, MATRIX)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tag", [t for t, _, _ in LAYOUTS])
def test_replica_bytes_equal_sglang_ranks(exact_results, version, tag, variant):
    """Reference executor bytes == compiled executor bytes == SGLang's own rank, whole and chunked; the plan's
    derived tensors are the w_kc / w_vc SGLang's post_load_weights built on that rank (less those that alias a
    parameter)."""
    r = exact_results.result(version, f"{tag}-{variant}")
    assert r["version"].startswith(version)
    assert not r["problems"], r["problems"]
    assert r["checked"] > 0 and r["chunked"] > 0
    assert r["compiled"] == r["checked"] and r["compiled_chunked"] == r["chunked"]
    assert not r["fallbacks"], r["fallbacks"]
    model, args = next((m, a) for t, m, a in LAYOUTS if t == tag)
    world = args["tp_size"]
    for rank in range(world):
        witness = torch.load(exact_results.witness_dir(version, f"{tag}-{variant}") / f"derived{rank}.pt")
        built = {n for n in witness if n.endswith((".w_kc", ".w_vc"))}
        if model not in MLA:
            assert not built and not r["derived"][str(rank)], r["derived"]
            continue
        assert built == {f"model.layers.{i}.self_attn.{w}" for i in range(3) for w in ("w_kc", "w_vc")}
        listed = set(r["derived"][str(rank)])
        # with one head per rank w_vc is a view of kv_b_proj.weight (a parameter p2p writes): not derived then
        assert listed <= built and (listed == built or world == 4) and listed, (listed, built)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("tag", sorted(FUSED))
def test_shared_expert_fusion_is_decided_as_the_rollout_decided(exact_results, version, tag):
    """The fused rollout's bytes are matched (above) by a replica that took the decision from the published
    parameters; the replica the trainer's device would build alone is refused, naming both layouts."""
    r = exact_results.result(version, f"{tag}-f32ids")
    world = dict(next(a for t, _, a in LAYOUTS if t == tag))["tp_size"]
    assert len(r["fusion_refusals"]) == world, r["fusion_refusals"]
    text = r["fusion_refusals"][0]
    assert "the rollout holds the shared expert as fused into routed w13/w2" in text
    assert "replica of that rank builds it as a separate shared_experts module" in text
    assert "--disable-shared-experts-fusion" in text
    witness = torch.load(exact_results.witness_dir(version, f"{tag}-f32ids") / "rank0.pt")
    assert not any(".shared_experts." in n for n in witness)  # the witness really fused


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("tag", sorted(SHARED_TP1))
def test_shared_expert_held_whole_is_read_from_the_published_sizes(exact_results, version, tag):
    """A rollout started with SGLANG_SHARED_EXPERT_TP1=1 holds its shared expert whole on every rank (and, with
    --moe-dense-tp-size 1, its dense MLP): its server info does not say so, so the replica reads it from the
    published sizes and is built so (bytes equal above); from the server info alone it would hold 1/tp shards."""
    r = exact_results.result(version, f"{tag}-f32ids")
    world = dict(next(a for t, _, a in LAYOUTS if t == tag))["tp_size"]
    whole = (2 * 32, 64)  # 2 x moe_intermediate_size x n_shared_experts rows, hidden_size columns
    layers = 2  # the MoE layers of the tiny config (the first is dense)
    assert r["shared_tp1"] == [True] * world
    shapes = {k: [tuple(s) for s in v] for k, v in r["shared_shapes"].items()}
    assert shapes["replica"] == [whole] * (world * layers)
    assert shapes["plain"] == [(whole[0] // world, whole[1])] * (world * layers)
    for rank in range(world):
        witness = torch.load(exact_results.witness_dir(version, f"{tag}-f32ids") / f"rank{rank}.pt")
        assert tuple(witness["model.layers.1.mlp.shared_experts.gate_up_proj.weight"].shape) == whole
        assert tuple(witness["model.layers.0.mlp.gate_up_proj.weight"].shape) == (2 * 128, 64)  # dense, whole

"""Qwen3.5's text models (`Qwen3_5MoeForCausalLM`, `Qwen3_5ForCausalLM`, SGLang 0.5.21 and 0.5.23
models/qwen3_5_text.py) are refused by p2p the way Qwen3-Next is, from the plain server args a GPU rollout serves.

They are Qwen3-Next's hybrid (gated-delta-net layers with full gated attention every `full_attention_interval`-th
layer) built on the same Gemma-style norms: SGLang's GemmaRMSNorm keeps `gemma_weight = weight + 1`, computed by
the norm's weight loader, which `/end_weight_update` never re-runs, so a p2p sync would leave it stale. The
README says so ("The Qwen3.5 hybrids share those norms"); this pins it. `RankReplica.build` captures every
parameter's plan (all fed by checkpoint tensors) and is then refused, naming exactly the norms' gemma_weight
buffers with the evidence (`derived.GEMMA_NORM`), before anything is written. If a release stops deriving them,
or p2p starts letting them through, this fails. The multimodal `*ForConditionalGeneration` classes (qwen3_5.py's
EntryClass) wrap the same text body and are not built here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import replica_harness as harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Qwen3.5 text config.json fields at tiny sizes (SGLang configs/qwen3_5.py Qwen3_5TextConfig, a Qwen3NextConfig):
# linear, full, linear, full layers (configs/qwen3_next.py layers_block_type reads full_attention_interval; real
# checkpoints also carry layer_types), gated-delta-net heads, gated full attention (attn_output_gate), and
# rope_parameters with an mrope_section as the published configs have (an empty rope config is refused by
# SGLang's rope factory).
_LAYERS, _INTERVAL = 4, 2
_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    full_attention_interval=_INTERVAL,
    layer_types=["full_attention" if (i + 1) % _INTERVAL == 0 else "linear_attention" for i in range(_LAYERS)],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    attn_output_gate=True,
    hidden_act="silu",
    attention_bias=False,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    partial_rotary_factor=0.25,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)
CONFIGS = {
    "Qwen3_5MoeForCausalLM": dict(
        _BASE, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", **_MOE
    ),
    "Qwen3_5ForCausalLM": dict(_BASE, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text"),
}


def _full(i: int) -> bool:
    return (i + 1) % _INTERVAL == 0


def hf_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors, as a Qwen3.5 text checkpoint names them (the gated-delta-net's in_proj_qkv,
    in_proj_z, in_proj_b, in_proj_a unfused; per-expert MoE names); its multi-token-prediction layer left out."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    v_heads = cfg["linear_num_value_heads"]
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_dim = v_heads * cfg["linear_value_head_dim"]
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out.append((f"{p}.input_layernorm.weight", (h,)))
        if _full(i):
            a = f"{p}.self_attn"
            out += [
                (f"{a}.q_proj.weight", (2 * heads * hd, h)),  # the query and its output gate
                (f"{a}.k_proj.weight", (kv * hd, h)),
                (f"{a}.v_proj.weight", (kv * hd, h)),
                (f"{a}.q_norm.weight", (hd,)),
                (f"{a}.k_norm.weight", (hd,)),
                (f"{a}.o_proj.weight", (h, heads * hd)),
            ]
        else:
            a = f"{p}.linear_attn"
            out += [
                (f"{a}.in_proj_qkv.weight", (2 * key_dim + value_dim, h)),
                (f"{a}.in_proj_z.weight", (value_dim, h)),
                (f"{a}.in_proj_b.weight", (v_heads, h)),
                (f"{a}.in_proj_a.weight", (v_heads, h)),
                (f"{a}.conv1d.weight", (2 * key_dim + value_dim, 1, cfg["linear_conv_kernel_dim"])),
                (f"{a}.dt_bias", (v_heads,)),
                (f"{a}.A_log", (v_heads,)),
                (f"{a}.norm.weight", (cfg["linear_value_head_dim"],)),
                (f"{a}.out_proj.weight", (h, value_dim)),
            ]
        out.append((f"{p}.post_attention_layernorm.weight", (h,)))
        if "num_experts" in cfg:
            mi, si = cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
            out.append((f"{p}.mlp.gate.weight", (cfg["num_experts"], h)))
            for e in range(cfg["num_experts"]):
                out += [
                    (f"{p}.mlp.experts.{e}.gate_proj.weight", (mi, h)),
                    (f"{p}.mlp.experts.{e}.up_proj.weight", (mi, h)),
                    (f"{p}.mlp.experts.{e}.down_proj.weight", (h, mi)),
                ]
            out += [
                (f"{p}.mlp.shared_expert.gate_proj.weight", (si, h)),
                (f"{p}.mlp.shared_expert.up_proj.weight", (si, h)),
                (f"{p}.mlp.shared_expert.down_proj.weight", (h, si)),
                (f"{p}.mlp.shared_expert_gate.weight", (1, h)),
            ]
        else:
            i_size = cfg["intermediate_size"]
            out += [
                (f"{p}.mlp.gate_proj.weight", (i_size, h)),
                (f"{p}.mlp.up_proj.weight", (i_size, h)),
                (f"{p}.mlp.down_proj.weight", (h, i_size)),
            ]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def write_checkpoint(path: Path, cfg: dict) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in hf_tensors(cfg)}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def gemma_norms(cfg: dict) -> set[str]:
    """SGLang's GemmaRMSNorms of the model, by module name: each layer's input and post-attention norms, the
    full-attention layers' q/k norms (SGLang's attention layer holds them itself), the final norm. The
    gated-delta-net's own norm is another class, with no derived buffer."""
    names = {"model.norm"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        names |= {f"{p}.input_layernorm", f"{p}.post_attention_layernorm"}
        if _full(i):
            names |= {f"{p}.q_norm", f"{p}.k_norm"}
    return names


_BUILD = """
import json, sys
from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
install_cpu_stubs()
import verl_p2p.replica.stream as stream
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint
captured = []
plan_rank = stream.plan_rank
stream.plan_rank = lambda *a, **k: captured.append(plan_rank(*a, **k)) or captured[-1]
args = {"tp_size": 2, "dtype": "bfloat16", "device": "cpu"}
for model in sys.argv[1:]:
    captured.clear()
    cfg = json.load(open(model + "/config.json"))
    got = {}
    try:
        stream.RankReplica.build(cfg, args, layout_from_server_args(args, 1), hf_specs_from_checkpoint(model))
        got["built"] = True
    except Exception as exc:
        got["error"] = [type(exc).__name__, str(exc)]
    if captured:
        plan = captured[-1].plan
        got["class"] = type(captured[-1].model).__name__
        got["params"] = sorted(plan.params)
        got["unfed"] = sorted(n for n, p in plan.params.items() if not p.feeds)
        got["derived"] = sorted(plan.derived)
    print("RESULT " + json.dumps({"model": model, **got}), flush=True)
"""


@pytest.mark.parametrize("version", ["0.5.21", "0.5.23"])
def test_qwen3_5_text_models_are_captured_then_refused_naming_their_gemma_norms(tmp_path, version):
    models = {arch: write_checkpoint(tmp_path / arch, cfg) for arch, cfg in CONFIGS.items()}
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD, *map(str, models.values())],
        env=harness.version_env(version),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.fspath(harness.REPO),
    )
    results = {
        json.loads(ln[len("RESULT ") :])["model"]: json.loads(ln[len("RESULT ") :])
        for ln in proc.stdout.splitlines()
        if ln.startswith("RESULT ")
    }
    assert proc.returncode == 0 and len(results) == len(models), proc.stderr[-3000:]
    for arch, model in models.items():
        got = results[str(model)]
        assert got.get("class") == arch, (arch, got.get("error"))  # SGLang built it and p2p captured its plan
        assert got["unfed"] == [] and len(got["params"]) > 30, (arch, got["unfed"])
        assert any(".linear_attn.in_proj_qkvz." in n for n in got["params"]), arch  # the hybrid's both layer kinds
        assert any(n.endswith(".qkv_proj.weight") for n in got["params"]), arch
        assert any(".mlp.experts." in n for n in got["params"]) == ("Moe" in arch), arch
        # the only derived tensors: every GemmaRMSNorm's gemma_weight, and nothing else
        assert got["derived"] == sorted(f"{m}.gemma_weight" for m in gemma_norms(CONFIGS[arch])), (arch, got["derived"])
        # refused, not silently captured: a sync would leave gemma_weight at the old weight + 1
        assert "built" not in got and got.get("error", [None])[0] == "WritePlanError", (arch, got)
        err = got["error"][1]
        n = len(got["derived"])
        assert f"SGLang computes {n} non-parameter tensors" in err and "leave them stale" in err, (arch, err)
        assert "known not rebuilt: GemmaRMSNorm's gemma_weight (its weight + 1)" in err, (arch, err)
        assert "never re-runs a weight loader" in err and f"({n} tensors" in err, (arch, err)
        assert "model.layers.0.input_layernorm.gemma_weight" in err, (arch, err)

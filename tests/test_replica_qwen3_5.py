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

import pytest
import torch
from support import replica_harness as harness

from verl_p2p.sandbox.tiny import tiny_config_dict, write_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# the tiny Qwen3.5 text models (verl_p2p/sandbox/tiny.py: config; planning/hf_names.py: the checkpoint's tensors,
# the gated-delta-net's in_proj_qkv/_z/_b/_a unfused, per-expert MoE names, no multi-token-prediction layer)
TINY_ARCHS = {"Qwen3_5MoeForCausalLM": "qwen3_5_moe", "Qwen3_5ForCausalLM": "qwen3_5"}


def gemma_norms(cfg: dict) -> set[str]:
    """SGLang's GemmaRMSNorms of the model, by module name: each layer's input and post-attention norms, the
    full-attention layers' q/k norms (SGLang's attention layer holds them itself), the final norm. The
    gated-delta-net's own norm is another class, with no derived buffer."""
    names = {"model.norm"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        names |= {f"{p}.input_layernorm", f"{p}.post_attention_layernorm"}
        if (i + 1) % cfg["full_attention_interval"] == 0:
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
    models = {
        arch: write_tiny_checkpoint(tmp_path / arch, tiny, id_encoded=False, dtype=torch.bfloat16)
        for arch, tiny in TINY_ARCHS.items()
    }
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
        assert got["derived"] == sorted(f"{m}.gemma_weight" for m in gemma_norms(tiny_config_dict(TINY_ARCHS[arch]))), (
            arch,
            got["derived"],
        )
        # refused, not silently captured: a sync would leave gemma_weight at the old weight + 1
        assert "built" not in got and got.get("error", [None])[0] == "WritePlanError", (arch, got)
        err = got["error"][1]
        n = len(got["derived"])
        assert f"SGLang computes {n} non-parameter tensors" in err and "leave them stale" in err, (arch, err)
        assert "known not rebuilt: GemmaRMSNorm's gemma_weight (its weight + 1)" in err, (arch, err)
        assert "never re-runs a weight loader" in err and f"({n} tensors" in err, (arch, err)
        assert "model.layers.0.input_layernorm.gemma_weight" in err, (arch, err)

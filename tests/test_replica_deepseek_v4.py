"""DeepSeek-V4 (`DeepseekV4ForCausalLM`, SGLang 0.5.23's models/deepseek_v4.py) on the CPU planning host: p2p refuses
it before any plan or write (`replica/model_class.UNSUPPORTED_CLASSES`), and this test pins the evidence, what stops
SGLang itself with p2p's refusal lifted:

- As published (V4-Flash: its first layers have compress ratio 0, pure sliding-window attention), the meta build
  stops in SGLang: on a CPU device `get_rope_wrapper` goes to `get_rope_cpu`, which only builds `deepseek_yarn`
  ropes and asserts a rope scaling, and MQALayer passes none for a ratio-0 layer.
- With every layer compressing (ratios 4/128 only: all yarn ropes) the class builds on `meta`, but the capture stops
  in SGLang's `default_weight_loader`, which reads the one-element `model.hc_head_scale` with `.item()`.
If either changes, this test fails: look again at what stops the class (and at post_load_weights' ape reorder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import replica_harness as harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Tiny V4-Flash shapes; every field is one deepseek_v4.py (or the layers it builds) reads. Published values where
# they are structural: one KV head (MQA), compress ratios from {0, 4, 128}, hash routing on the first layers,
# sqrtsoftplus noaux_tc routing with one shared expert, yarn rope with a compressed-rope theta, hc_mult 4.
CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_act": "silu",
    "hidden_size": 64,
    "vocab_size": 256,
    "num_hidden_layers": 4,
    "num_nextn_predict_layers": 0,
    "compress_ratios": [0, 0, 4, 128],
    "compress_rope_theta": 160000.0,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 16,
    "o_groups": 2,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 8,
    "sliding_window": 8,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "num_hash_layers": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

_PROBE = r"""
import json, sys, traceback
import torch
from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
install_cpu_stubs()
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.replica.plan import build_meta_model
from verl_p2p.replica.rank_context import RankContext
from verl_p2p.replica.stream import RankReplica

cfg = json.loads(sys.argv[1])
args = {"tp_size": 1, "dtype": "bfloat16", "device": "cpu"}
layout = layout_from_server_args(args, 0)
RENAMES = (("model.embed_tokens.", "embed."), ("lm_head.", "head."), ("model.norm.", "norm."),
           ("model.hc_head", "hc_head"), ("model.layers.", "layers."), (".self_attn.", ".attn."), (".mlp.", ".ffn."),
           (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".ffn_norm."),
           (".gate.e_score_correction_bias", ".gate.bias"), (".topk.tid2eid", ".gate.tid2eid"))
SPLITS = {".wqkv_a.weight": ("wqkv_a", "wq_a", "wkv"), ".wkv_gate.weight": ("wkv_gate", "wkv", "wgate"),
          ".gate_up_proj.weight": ("gate_up_proj", "w1", "w3")}


def hf_specs(model):
    # the checkpoint names SGLang's load_weights maps back (remap_weight_name_to_dpsk_hf_format, its fusions)
    specs = {}
    for name, p in model.named_parameters():
        shape, n = tuple(p.shape), name
        for a, b in RENAMES:
            n = n.replace(a, b)
        split = next((s for e, s in SPLITS.items() if n.endswith(e)), None)
        if split:
            fused, first, second = split
            rows = cfg["q_lora_rank"] if fused == "wqkv_a" else shape[0] // 2
            specs[n.replace(fused, first)] = ((rows, shape[1]), p.dtype)
            specs[n.replace(fused, second)] = ((shape[0] - rows, shape[1]), p.dtype)
        elif n.endswith(".down_proj.weight"):
            specs[n.replace("down_proj", "w2")] = (shape, p.dtype)
        elif n.endswith(".experts.w13_weight"):
            for e in range(shape[0]):
                for w in ("w1", "w3"):
                    specs[n.replace("w13_weight", f"{e}.{w}.weight")] = ((shape[1] // 2, shape[2]), p.dtype)
        elif n.endswith(".experts.w2_weight"):
            for e in range(shape[0]):
                specs[n.replace("w2_weight", f"{e}.w2.weight")] = (shape[1:], p.dtype)
        else:
            specs[n] = (shape, p.dtype)
    return specs


def stop(exc):
    frames = traceback.extract_tb(exc.__traceback__)
    inner = [f for f in frames if "/sglang/" in f.filename]
    last = inner[-1]
    where = lambda f: f"{f.filename.split('/sglang/', 1)[1]}:{f.lineno}:{f.name}"
    return {"type": type(exc).__name__, "msg": str(exc), "at": where(last), "line": last.line,
            "frames": [where(f) for f in inner], "notes": list(getattr(exc, "__notes__", []))}


out = {}
try:  # p2p's own refusal, first: nothing built
    RankReplica.build(cfg, args, layout, {})
    out["refused"] = None
except Exception as exc:
    out["refused"] = {"type": type(exc).__name__, "msg": str(exc)}
from verl_p2p.replica import model_class
model_class.UNSUPPORTED_CLASSES.pop("DeepseekV4ForCausalLM")  # the evidence: what SGLang does without it
try:  # as published: ratio-0 layers first
    RankReplica.build(cfg, args, layout, {})
    out["published"] = {"built": True}
except Exception as exc:
    out["published"] = stop(exc)
allc = dict(cfg, compress_ratios=[4, 128, 4, 128])
model = build_meta_model(RankContext(args, layout, allc))
out["compressed_params"] = {n: str(p.device) for n, p in model.named_parameters()}
try:
    rep = RankReplica.build(allc, args, layout, hf_specs(model))
    out["compressed"] = {"built": True, "params": len(rep.plan.params), "derived": list(rep.plan.derived)}
except Exception as exc:
    out["compressed"] = stop(exc)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(
    harness.SGLANG_DIRS["0.5.23"] is None or not harness.SGLANG_DIRS["0.5.23"].is_dir(),
    reason="needs .venv/sglang-0.5.23 (scripts/setup.sh)",
)
def test_deepseek_v4_is_refused_and_what_stops_sglang_is_pinned():
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(CONFIG)],
        env=harness.version_env("0.5.23"),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=os.fspath(harness.REPO),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT ") :])

    # 0. p2p refuses the class itself, naming it, what stops it and the fix
    refused = got["refused"]
    assert refused and refused["type"] == "UnsupportedModelClassError", refused
    for part in (
        "DeepseekV4ForCausalLM",
        "get_rope_cpu",
        "hc_head_scale",
        "compressor.ape",
        "nothing was written",
        "checkpoint_engine.backend",
    ):
        assert part in refused["msg"], (part, refused)

    # 1. as published: the meta build of layer 0 (compress ratio 0) asserts in SGLang's CPU rope factory
    pub = got["published"]
    assert pub.get("type") == "AssertionError" and pub["msg"] == "", pub
    assert pub["at"] == "srt/layers/rotary_embedding/factory.py:478:get_rope_cpu", pub
    assert pub["line"] == "assert rope_scaling is not None", pub
    assert "srt/models/deepseek_v4.py:1395:__init__" in pub["frames"], pub  # MQALayer's get_rope_wrapper call
    assert "srt/model_loader/loader.py" in " ".join(pub["frames"]), pub  # inside _initialize_model: no plan yet

    # 2. every layer compressing: all of it builds on meta (hyper-connection params included) ...
    devices = got["compressed_params"]
    assert set(devices.values()) == {"meta"}, devices
    assert {"model.hc_head_scale", "model.layers.0.hc_attn_fn", "model.layers.0.self_attn.compressor.ape"} <= set(
        devices
    )
    # ... and the capture stops where SGLang's default loader reads a one-element tensor's value on meta
    comp = got["compressed"]
    assert comp.get("type") == "RuntimeError", comp
    assert comp["msg"] == "Tensor.item() cannot be called on meta tensors", comp
    assert comp["frames"][-1] == "srt/model_loader/weight_utils.py:1580:default_weight_loader", comp
    assert comp["line"] == "param.data.fill_(loaded_weight.item())", comp
    assert any("name='model.hc_head_scale'" in n for n in comp["notes"]), comp

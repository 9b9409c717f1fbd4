"""Qwen3-Next (`Qwen3NextForCausalLM`) on SGLang 0.5.21 and 0.5.23: how far the replica gets, and the refusal that
stops it, from the plain server args a GPU rollout serves.

Two things used to stop its plan before SGLang's loader ran, and no longer do:
- on a CPU host SGLang refuses this class's GPU scheduler settings (the Mamba cache's `extra_buffer`, then the
  overlap schedule): the replica's planning context takes the CPU-legal ones itself;
- SGLang allocates the gated-delta-net norms on the device directly: the capture moves them to `meta`.
What stops it now is p2p's own guard, by design: SGLang's Gemma-style norms derive a `gemma_weight` tensor from
each norm's weight after loading, which is not on the allow-list of derivations a session end is known to rebuild
(only MLA's w_kc/w_vc are), so a sync would leave them stale. The plan is refused before anything is written,
naming them. Lifting it takes a proof that the session end rebuilds them (a loopback session, as for MLA) and the
exactness witnesses for this class."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support import replica_harness as harness

from verl_p2p.sandbox.tiny import write_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

_PLAN = """
import json
from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
install_cpu_stubs()
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.replica.plan import check_syncable
from verl_p2p.replica.stream import plan_rank
from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint
model = {model!r}
cfg = json.load(open(model + "/config.json"))
args = {{"tp_size": 2, "dtype": "bfloat16", "device": "cpu"}}
planned = plan_rank(cfg, args, layout_from_server_args(args, 1), hf_specs_from_checkpoint(model), None)
params = planned.plan.params
norm = "model.layers.0.linear_attn.norm.weight" in params
unfed = [n for n, p in params.items() if not p.feeds]
print("CAPTURED " + json.dumps({{"n": len(params), "norm": norm, "unfed": unfed}}))
check_syncable(planned.plan)
print("SYNCABLE")
"""


@pytest.mark.parametrize("version", ["0.5.21", "0.5.23"])
def test_qwen3_next_is_captured_then_refused_naming_its_derived_norms(tmp_path, version):
    import json

    model = write_tiny_checkpoint(tmp_path / "next", "qwen3_next", id_encoded=False, dtype=torch.bfloat16)
    proc = subprocess.run(
        [sys.executable, "-c", _PLAN.format(model=str(model))],
        env=harness.version_env(version),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.fspath(harness.REPO),
    )
    captured = [ln for ln in proc.stdout.splitlines() if ln.startswith("CAPTURED ")]
    assert captured, proc.stderr[-3000:]  # past SGLang's CPU-platform asserts and the device-allocated norms
    got = json.loads(captured[-1][len("CAPTURED ") :])
    assert got["norm"] and got["unfed"] == [] and got["n"] > 40, got  # every parameter fed by checkpoint tensors
    assert proc.returncode != 0 and "SYNCABLE" not in proc.stdout
    err = proc.stderr[-3000:]
    assert "WritePlanError" in err and "input_layernorm.gemma_weight" in err and "leave them stale" in err, err
    # with the evidence: SGLang's session end never re-runs the norm's weight loader that computes it
    assert "known not rebuilt: GemmaRMSNorm's gemma_weight" in err and "never re-run" in err, err


def test_qwen3_next_checkpoint_tensor_list_is_transformers_own():
    """The tiny checkpoint's tensors (planning/hf_names) are those of transformers' Qwen3-Next model, with the
    per-expert names real checkpoints use (transformers 5 fuses the experts in memory)."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    from verl_p2p.planning.hf_names import hf_tensor_specs
    from verl_p2p.sandbox.tiny import tiny_config_dict

    cfg = tiny_config_dict("qwen3_next")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            Qwen3NextConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
        )
    theirs = {}
    for name, p in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            experts, two_i, h = p.shape
            for e in range(experts):
                for leaf in ("gate_proj", "up_proj"):
                    theirs[name.replace("gate_up_proj", f"{e}.{leaf}.weight")] = (two_i // 2, h)
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(p.shape[0]):
                theirs[name.replace("down_proj", f"{e}.down_proj.weight")] = tuple(p.shape[1:])
        else:
            theirs[name] = tuple(p.shape)
    assert {n: tuple(s) for n, s, _ in hf_tensor_specs(cfg)} == theirs

"""verl_p2p.sandbox.te_free: verl's Megatron-Bridge model without transformer_engine (the tiny GPU run's trainer).

In a fresh interpreter where verl imports the module (VERL_USE_EXTERNAL_MODULES), the tiny run's Qwen3 is built
the way verl 0.9.1's Megatron engine builds it, with the recipe's overrides; its forward on verl's BSHD batch
(right-padded, (batch, seq) padding mask) must equal HF transformers' logits on every real token, and afterwards
the process must look like any host without TE (no TE import, torch's AdamW, no gradient-accumulation fusion).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_p2p.sandbox.te_free import REQUIRED_FALSE, te_free_overrides

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tiny")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "tiny" / "make_tiny.py"), str(out)], env=env, check=True, timeout=300
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "te_free_child.py"), str(out / "model")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TE_FREE_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("TE_FREE_RESULT "))


def test_forward_on_verl_bshd_batch_equals_hf(child):
    assert child["core_attention"] == ["verl_p2p.sandbox.te_free.CausalDotProductAttention"]
    assert child["te_modules"] == []
    assert child["max_abs_diff_vs_hf"] < 1e-3 * max(1.0, child["logit_scale"])


def test_hf_export_of_the_local_layers_is_the_checkpoint_bit_for_bit(child):
    assert child["hf_export_same_names"] and child["hf_export_bit_equal"]


def test_process_looks_te_free_after_the_bridge_import(child):
    assert child["hook_before_bridge"]
    assert child["import_te_after"] == "ImportError" and not child["te_importable_after"]
    assert child["mcore_have_te"] is False
    assert child["mcore_adam"] == "torch.optim.adamw.AdamW"
    assert child["grad_accum_fusion_available"] is False


def test_layer_spec_refuses_a_fusion_it_cannot_run():
    from verl_p2p.errors import P2PConfigError
    from verl_p2p.sandbox.te_free import te_free_layer_spec

    class Config:
        gradient_accumulation_fusion = True

    with pytest.raises(P2PConfigError, match=r"override_transformer_config\.gradient_accumulation_fusion=false"):
        te_free_layer_spec(Config())


def test_overrides_name_every_required_flag():
    overrides = te_free_overrides()
    assert "actor_rollout_ref.actor.megatron.use_remove_padding=false" in overrides
    for name in REQUIRED_FALSE:
        assert f"+actor_rollout_ref.actor.megatron.override_transformer_config.{name}=false" in overrides

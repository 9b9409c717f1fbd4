"""Smoke run of `verl-p2p bench` at a tiny size: the program runs end to end, verifies the receivers'
bytes and writes its JSON (the real numbers come from the full-size run, not from CI)."""

from __future__ import annotations

import json

import pytest

from verl_p2p.cli.bench import BenchShape, run_bench

pytestmark = pytest.mark.slow


def test_bench_smoke(tmp_path):
    shape = BenchShape(
        hidden_size=128,
        num_hidden_layers=2,
        num_experts=4,
        moe_intermediate_size=64,
        vocab_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    out = tmp_path / "bench.json"
    result = run_bench(out_path=str(out), shape=shape, slot_mb=1, repeats=1)
    saved = json.loads(out.read_text())
    assert saved["verified"] is True and saved["bytes_per_target"] == result["bytes_per_target"]
    assert len(result["bytes_per_target"]) == 4
    assert result["total_bytes_written"] == sum(result["bytes_per_target"].values()) == 2 * result["bytes_loaded"]
    assert result["push_seconds"][0] > 0 and result["raw_seconds"][0] > 0 and result["staging_over_slots"] >= 1.0

"""Smoke runs of `verl-p2p bench` at a tiny size: the push bench (with its broadcast baseline) and the
conversion bench (`--device cpu`) run end to end, verify the bytes they produce and write their JSON (the
real numbers come from the full-size runs, not from CI)."""

from __future__ import annotations

import json

import pytest

from verl_p2p.cli.bench import main, model_shape, run_bench

pytestmark = pytest.mark.slow


def test_bench_smoke(tmp_path):
    shape = model_shape("tiny")
    out = tmp_path / "bench.json"
    result = run_bench(out_path=str(out), shape=shape, slot_mb=1, repeats=1)
    saved = json.loads(out.read_text())
    assert saved["verified"] is True and saved["bytes_per_target"] == result["bytes_per_target"]
    assert len(result["bytes_per_target"]) == 4
    assert result["total_bytes_written"] == sum(result["bytes_per_target"].values()) == 2 * result["bytes_loaded"]
    assert result["push_seconds"][0] > 0 and result["raw_seconds"][0] > 0 and result["staging_over_slots"] >= 1.0
    # the broadcast baseline moved the whole checkpoint to each of the 4 ranks, and their bytes were checked
    assert result["broadcast_bytes_written"] == 4 * result["model_bytes"]
    assert len(result["broadcast_seconds"]) == 1 and result["p2p_speedup_vs_broadcast"] > 0
    assert result["executor"] == "compiled" and result["goals"]["p2p_speedup_vs_broadcast"] == 1.6


def test_convert_bench_smoke(tmp_path):
    """`verl-p2p bench --device cpu`: both executors, every compiled byte checked against SGLang's loader."""
    out = tmp_path / "convert.json"
    argv = ["--device", "cpu", "--model", "tiny", "--repeats", "1", "--slot-mb", "1", "--out", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["command"] == "verl-p2p bench " + " ".join(argv)
    assert r["verified_params"] == r["params_per_source"] > 0 and not r["compiled_fallback_params"]
    assert {(x["executor"], x["slots"]) for x in r["runs"]} == {("compiled", "host"), ("sglang", "host")}
    assert all(x["convert_gbps"] > 0 and x["stage_gbps"] > 0 for x in r["runs"])
    assert r["ratios"]["host"]["convert"] > 0 and r["compiled_launches"] < r["compiled_copies"]

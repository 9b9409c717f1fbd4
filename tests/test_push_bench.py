"""Smoke runs of `verl-p2p bench` at a tiny size: the push bench (with its broadcast baseline) and the
conversion bench (`--device cpu`) run end to end, verify the bytes they produce and write their JSON (the
real numbers come from the full-size runs, not from CI: here only bytes, verification and the report's own
arithmetic are asserted, each of which a broken bench would fail)."""

from __future__ import annotations

import json
import statistics

import pytest

from verl_p2p.cli.bench import main, model_shape, run_bench

pytestmark = pytest.mark.slow


def test_bench_smoke(tmp_path):
    """Bytes against the layout and the checkpoint, the verification ran, and the report's arithmetic matches its
    own measurements (the timings themselves are the full-size runs' business, not CI's)."""
    shape = model_shape("tiny")
    out = tmp_path / "bench.json"
    result = run_bench(out_path=str(out), shape=shape, slot_mb=1, repeats=1)
    r = json.loads(out.read_text())
    assert r == json.loads(json.dumps(result))  # the file is the returned report
    assert r["verified"] is True  # _verify ran (it returns True or raises on the first differing receiver)
    engines, tp = r["engines"], r["tp_size"]
    per_target = r["bytes_per_target"]
    assert sorted(per_target) == sorted(f"e{e}r{k}" for e in range(engines) for k in range(tp))
    for k in range(tp):  # engines of one layout receive the same bytes, rank for rank
        assert len({per_target[f"e{e}r{k}"] for e in range(engines)}) == 1, per_target
    one_engine = sum(per_target[f"e0r{k}"] for k in range(tp))
    # each layout's bytes are loaded once and written to every engine; every checkpoint byte lands somewhere
    assert r["bytes_loaded"] == one_engine >= r["model_bytes"]
    assert r["total_bytes_written"] == sum(per_target.values()) == engines * r["bytes_loaded"]
    assert r["broadcast_bytes_written"] == engines * tp * r["model_bytes"]  # the whole checkpoint to every rank
    # the report's derived numbers are those of its own measurements
    assert len(r["push_seconds"]) == len(r["raw_seconds"]) == len(r["broadcast_seconds"]) == 1
    assert r["push_seconds_median"] == statistics.median(r["push_seconds"])
    assert r["push_gbps"] == pytest.approx(r["total_bytes_written"] / r["push_seconds_median"] / 1e9)
    assert r["push_over_raw"] == pytest.approx(r["push_seconds"][0] / r["raw_seconds"][0])
    assert r["p2p_speedup_vs_broadcast"] == pytest.approx(r["broadcast_seconds"][0] / r["push_seconds"][0])
    slots = 2 * r["slot_bytes"]
    assert r["staging_bytes"] == r["peak_staged_bytes"] + slots
    assert r["staging_over_slots"] == pytest.approx(r["staging_bytes"] / slots)
    assert r["executor"] == "compiled" and r["goals"]["p2p_speedup_vs_broadcast"] == pytest.approx(0.8 * tp)


def test_convert_bench_smoke(tmp_path):
    """`verl-p2p bench --device cpu`: both executors, every compiled byte checked against SGLang's loader."""
    out = tmp_path / "convert.json"
    argv = ["--device", "cpu", "--model", "tiny", "--repeats", "1", "--slot-mb", "1", "--out", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["command"] == "verl-p2p bench " + " ".join(argv)
    assert r["verified_params"] == r["params_per_source"] > 0 and not r["compiled_fallback_params"]
    assert {(x["executor"], x["slots"]) for x in r["runs"]} == {("compiled", "host"), ("sglang", "host")}
    for x in r["runs"]:  # both executors produce the same bytes; the rates are those of the recorded seconds
        assert x["target_bytes"] == r["target_bytes_per_source"] >= r["model_bytes"] // r["tp_size"]
        assert len(x["convert_seconds"]) == len(x["stage_seconds"]) == r["repeats"] == 1
        assert x["convert_gbps"] == pytest.approx(x["target_bytes"] / x["convert_seconds"][0] / 1e9)
        assert x["stage_gbps"] == pytest.approx(x["target_bytes"] / x["stage_seconds"][0] / 1e9)
    by = {x["executor"]: x for x in r["runs"]}
    assert r["ratios"]["host"]["convert"] == pytest.approx(
        by["compiled"]["convert_gbps"] / by["sglang"]["convert_gbps"]
    )
    assert r["compiled_launches"] < r["compiled_copies"]

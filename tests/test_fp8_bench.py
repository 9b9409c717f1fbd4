"""`verl-p2p bench --device cpu --fp8`: FP8 targets beside bf16, the quantize step inside the timed conversion.

The bench model cut to one layer of four experts (its projections are multiples of 128, as block FP8 needs at
TP2/EP2); every compiled FP8 byte is checked against SGLang's loader fed by the same quantize step.
"""

from __future__ import annotations

import json

from verl_p2p.cli.bench import main


def test_convert_bench_with_fp8_targets(tmp_path):
    out = tmp_path / "convert.json"
    argv = ["--device", "cpu", "--fp8", "--model", "bench", "--layers", "1", "--experts", "4"]
    argv += ["--repeats", "1", "--slot-mb", "8", "--no-stage", "--out", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    fp8 = r["fp8"]
    assert fp8["verified_params"] == fp8["params_per_source"] > r["params_per_source"]  # + one scale per weight
    assert not fp8["compiled_fallback_params"]
    # e4m3fn weights are half the bf16 bytes; embeddings, norms, router and lm_head stay bf16
    assert 0 < fp8["target_bytes_per_source"] < r["target_bytes_per_source"]
    rows = {(x["weights"], x["executor"], x["slots"]): x for x in r["runs"]}
    assert set(rows) == {(w, e, "host") for w in ("bf16", "fp8") for e in ("compiled", "sglang")}
    assert rows["fp8", "compiled", "host"]["target_bytes"] == fp8["target_bytes_per_source"]
    assert all(x["convert_gbps"] > 0 for x in r["runs"])

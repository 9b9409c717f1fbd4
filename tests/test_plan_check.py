"""`verl-p2p plan --check-measured` and the whole-sync rates: predicted vs every committed GPU run."""

from __future__ import annotations

import json

import pytest

from verl_p2p.cli.plan import main
from verl_p2p.cli.plan_rates_file import MEASUREMENTS, RATES_FILE, derive_rates
from verl_p2p.planning.whole_sync import parse_link

RUNS = json.loads((MEASUREMENTS / "measured_runs.json").read_text())


def test_rates_table_is_derived_from_the_named_files():
    assert json.loads(RATES_FILE.read_text()) == json.loads(json.dumps(derive_rates()))
    for fig in derive_rates()["rates"].values():
        assert fig["file"].startswith("docs/measurements/") and fig["field"]


def test_check_measured_on_the_committed_runs(capsys):
    rc = main(["--check-measured"])
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if line.startswith("| ")}
    for run in RUNS["runs"] + RUNS["skipped"]:
        assert run["file"] in rows
    held = [r["file"] for r in RUNS["runs"] if r["role"] == "held_out"]
    outside = [f for f in held if "**NO**" in rows[f]]
    assert rc == (1 if outside else 0)
    # the syncs that move real bytes and the learning-task syncs are predicted within the band
    for name in (
        "grpo_h200_one_step_off_qwen3_4b_p2p.json",
        "grpo_h100_learn_one_step_off_p2p.json",
        "grpo_h100_learn_fsdp_one_step_off_p2p.json",
        "e2e_h200_qwen3_4b.json",
        "e2e_h200_sglang0521_qwen3.json",
        "e2e_h200_sglang0521_fp8_qwen3_moe.json",
    ):
        assert "**NO**" not in rows[name], rows[name]


def _one_run(tmp_path, scale: float):
    run = next(r for r in RUNS["runs"] if r["file"] == "e2e_h200_sglang0521_qwen3.json")
    data = json.loads((MEASUREMENTS / run["file"]).read_text())
    data["models"]["qwen3"]["figures"]["steady_state_paused_median_s"] *= scale
    planted = tmp_path / "planted_run.json"
    planted.write_text(json.dumps(data))
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps({"band": 0.25, "runs": [dict(run, file=str(planted))], "skipped": []}))
    return runs, planted


def test_a_planted_run_outside_the_band_exits_1_naming_it(tmp_path, capsys):
    runs, planted = _one_run(tmp_path, 1.0)
    assert main(["--check-measured", "--measured-runs", str(runs)]) == 0
    capsys.readouterr()
    runs, planted = _one_run(tmp_path, 2.0)
    table = tmp_path / "check_table"
    assert main(["--check-measured", "--measured-runs", str(runs), "--table", str(table)]) == 1
    out = capsys.readouterr().out
    assert f"outside ±25%: {planted}" in out
    assert "**NO**" in table.read_text()


def test_link_forms():
    assert parse_link("tcp-one-host").describe() == "tcp-one-host"
    assert parse_link("rdma:400").gbits == 400
    with pytest.raises(ValueError, match="--link"):
        parse_link("rdma:x")

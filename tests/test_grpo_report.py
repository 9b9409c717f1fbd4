"""scripts/grpo_report.py: a GPU GRPO run's folder (plain files, or summary.json beside PACK=1's logs.tgz) becomes
the report's JSON, table and plot; the figures come from verl's own metrics, the verdicts from the summary."""

from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("grpo_report", ROOT / "scripts" / "grpo_report.py")
grpo_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grpo_report)


def write_run(folder: Path, sync_s: list[float], paused: bool, ok: bool = True, pack: bool = False) -> Path:
    folder.mkdir(parents=True)
    rows = [{"step": 0, "data": {"val-core/x": 0.0}}]
    for step, seconds in enumerate(sync_s, start=1):
        data = {"training/global_step": step, "timing_s/update_weights": seconds, "critic/rewards/mean": step / 10}
        if paused:
            data.update({"checkpoint_engine/p2p/phase/total_s": seconds / 2, "checkpoint_engine/p2p/bytes": 100.0})
        rows.append({"step": step, "data": data})
    summary = {"ok": ok, "steps_completed": len(sync_s), "first_sync_weight_check": {"verdict": "passed"}}
    summary["greedy_vs_fresh_server"] = {"greedy_equal": ok, "checksums_equal": ok, "checksums_compared": 19}
    (folder / "summary.json").write_text(json.dumps(summary))
    metrics = folder / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in rows))
    if pack:
        with tarfile.open(folder / "logs.tgz", "w:gz") as tar:
            tar.add(metrics, arcname="./metrics.jsonl")
        metrics.unlink()
    return folder


def test_two_runs_side_by_side_with_the_steady_state_ratio(tmp_path):
    p2p = write_run(tmp_path / "p2p", [5.0, 1.0, 1.0, 1.2], paused=True)
    verl = write_run(tmp_path / "mooncake", [6.0, 3.0, 3.0, 3.6], paused=False, pack=True)
    out = tmp_path / "out"
    rc = grpo_report.main(
        [str(p2p), str(verl), "--names", "p2p,mooncake", "--command", "A", "--command", "B", "--device-seconds", "300",
         "--out-dir", str(out), "--table", "table.txt", "--png", "plot.png"]
    )  # fmt: skip
    assert rc == 0
    rep = json.loads((out / "p2p.json").read_text())
    assert rep["command"] == "A" and rep["device_seconds"] == 300.0 and rep["checks"]["fresh_server_checksums_equal"]
    assert [s["sync_s"] for s in rep["steps"]] == [5.0, 1.0, 1.0, 1.2] and rep["steady_sync_s_median"] == 1.0
    assert rep["steps"][0]["paused_s"] == 2.5 and rep["steps"][0]["bytes"] == 100.0
    other = json.loads((out / "mooncake.json").read_text())  # its metrics came out of logs.tgz
    assert other["steady_sync_s_median"] == 3.0 and other["steps"][1]["paused_s"] is None
    table = (out / "table.txt").read_text()
    assert "| 2 | 1.000 | 0.500 | 100 | 3.000 | - | - |" in table and "mooncake / p2p = 3.00" in table
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_run_makes_the_report_fail(tmp_path):
    bad = write_run(tmp_path / "bad", [1.0, 1.0], paused=True, ok=False)
    assert grpo_report.main([str(bad), "--names", "bad", "--out-dir", str(tmp_path / "out")]) == 1
    assert json.loads((tmp_path / "out" / "bad.json").read_text())["checks"]["ok"] is False


def test_a_fully_async_run_reports_p2p_syncs_by_version_and_partial_rollouts(tmp_path):
    """fully_async's training steps carry no sync timer: the report takes each version's figures from the summary's
    sync log (numeric order, 10 after 9) and keeps verl's partial-rollout counts."""
    run = write_run(tmp_path / "fa", [], paused=False)
    summary = json.loads((run / "summary.json").read_text())
    summary["mode"] = "fully_async"
    summary["p2p_sync_log"] = {
        str(v): {"checkpoint_engine/p2p/seconds/total": 0.01 * (v + 1), "checkpoint_engine/p2p/bytes": 7.0}
        for v in (10, 0, 9)
    }
    summary["fully_async"] = {"partial_rollouts": 31.0, "versions_non_decreasing": True}
    (run / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "out"
    assert grpo_report.main([str(run), "--names", "fa", "--out-dir", str(out), "--png", "fa.png"]) == 0
    rep = json.loads((out / "fa.json").read_text())
    assert [s["version"] for s in rep["syncs"]] == ["0", "9", "10"] and rep["syncs"][2]["sync_s"] == 0.11
    assert rep["syncs"][0]["bytes"] == 7.0 and rep["fully_async"]["partial_rollouts"] == 31.0
    assert (out / "fa.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

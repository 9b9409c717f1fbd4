"""scripts/grpo_report.py: a GPU GRPO run's folder (plain files, or summary.json beside PACK=1's logs.tgz) becomes
the report's JSON, table and plot; the figures come from verl's own metrics, the verdicts from the summary."""

from __future__ import annotations

import importlib.util
import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("grpo_report", ROOT / "scripts" / "grpo_report.py")
grpo_report = importlib.util.module_from_spec(spec)
sys.modules["grpo_report"] = grpo_report  # its dataclasses look their module up
spec.loader.exec_module(grpo_report)


def write_run(
    folder: Path,
    sync_s: list[float],
    paused: bool,
    ok: bool = True,
    pack: bool = False,
    backend: str = "p2p",
    rewards: list[float] | None = None,
    val_end: float | None = None,
) -> Path:
    """A run folder as gpu_grpo_run.sh leaves it. p2p's lifecycle logs its paused window (abort .. resume) and its
    whole sync (connect and prepare before the abort, then the pause) as two metrics: here a quarter and a half
    of verl's timer, so a report that takes one for the other is seen."""
    folder.mkdir(parents=True)
    rows = [{"step": 0, "data": {"val-core/x": 0.0}}]
    rewards = rewards if rewards is not None else [step / 10 for step in range(1, len(sync_s) + 1)]
    for step, (seconds, reward) in enumerate(zip(sync_s, rewards, strict=True), start=1):
        data = {"training/global_step": step, "timing_s/update_weights": seconds, "critic/rewards/mean": reward}
        data["actor/kl_loss"] = 0.001 * (step - 1)  # the actor drifts from its reference as it trains
        if paused:
            data.update(
                {
                    "checkpoint_engine/p2p/phase/paused_s": seconds / 4,
                    "checkpoint_engine/p2p/phase/total_s": seconds / 2,
                    "checkpoint_engine/p2p/bytes": 100.0,
                }
            )
        rows.append({"step": step, "data": data})
    if val_end is not None:  # verl's validation after the last step, logged at that step
        rows.append({"step": len(sync_s), "data": {"val-core/x": val_end}})
    summary = {"ok": ok, "steps_completed": len(sync_s), "first_sync_weight_check": {"verdict": "passed"}}
    summary["backend"] = backend
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
    verl = write_run(tmp_path / "mooncake", [6.0, 3.0, 3.0, 3.6], paused=False, pack=True, backend="mooncake")
    out = tmp_path / "out"
    rc = grpo_report.main(
        [str(p2p), str(verl), "--names", "p2p,mooncake", "--command", "A", "--command", "B", "--device-seconds", "300",
         "--out-dir", str(out), "--table", "table.txt", "--png", "plot.png"]
    )  # fmt: skip
    assert rc == 0
    rep = json.loads((out / "p2p.json").read_text())
    assert rep["command"] == "A" and rep["device_seconds"] == 300.0 and rep["checks"]["fresh_server_checksums_equal"]
    assert [s["sync_s"] for s in rep["steps"]] == [5.0, 1.0, 1.0, 1.2] and rep["steady_sync_s_median"] == 1.0
    # the paused window is phase/paused_s; phase/total_s (connect + prepare + the pause) is its own column
    assert rep["steps"][0]["paused_s"] == 1.25 and rep["steps"][0]["total_s"] == 2.5
    assert rep["steps"][0]["bytes"] == 100.0 and rep["backend"] == "verl_p2p"
    assert rep["steady_paused_s_median"] == 0.25 and rep["steady_total_s_median"] == 0.5
    other = json.loads((out / "mooncake.json").read_text())  # its metrics came out of logs.tgz
    assert other["steady_sync_s_median"] == 3.0 and other["steps"][1]["paused_s"] is None
    assert other["backend"] == "mooncake"
    table = (out / "table.txt").read_text()
    assert "| 2 | 1.000 | 0.250 | 0.500 | 100 | 3.000 | - | - | - |" in table and "mooncake / p2p = 3.00" in table
    assert "| p2p | verl_p2p | 4 | 0.250 | 0.250 | x 0.000 -> 0.000 (steps 0, 0) | 1.000 | 0.250 | 0.500 |" in table
    assert "goal (issue 34)" not in table  # 4 steps: the first and last 10 overlap, no goal is judged
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


def test_learning_runs_are_judged_by_issue_34s_goals(tmp_path):
    """Per run the first-10 and last-10 step mean reward; the goals: p2p and verl's engine each rise (last-10 >= 0.5
    and >= 3x first-10), their last-10 means within 0.1, the negative control flat (within 0.05)."""
    steps = 60
    rising = [min(0.05 + 0.02 * i, 0.9) for i in range(steps)]
    p2p = write_run(tmp_path / "p2p", [0.02] * steps, paused=True, rewards=rising, val_end=0.95)
    behind = [r - 0.03 for r in rising]
    moon = write_run(tmp_path / "moon", [0.2] * steps, paused=False, backend="mooncake", rewards=behind)
    flat = write_run(tmp_path / "ctl", [0.001] * steps, paused=False, backend="control", rewards=[0.05] * steps)
    out = tmp_path / "out"
    args = [str(p2p), str(moon), str(flat), "--names", "p2p,mooncake,control", "--out-dir", str(out)]
    assert grpo_report.main([*args, "--table", "table.txt", "--png", "learn.png", "--require-goals"]) == 0
    rep = json.loads((out / "p2p.json").read_text())
    assert rep["reward"] == {"steps": 60, "first10_mean": pytest.approx(0.14), "last10_mean": 0.9}
    assert rep["validation"]["start"] == {"step": 0, "metrics": {"val-core/x": 0.0}}
    assert rep["validation"]["end"] == {"step": 60, "metrics": {"val-core/x": 0.95}}
    assert json.loads((out / "control.json").read_text())["backend"] == "control"
    table = (out / "table.txt").read_text()
    assert "| p2p learns | last-10 mean >= 0.5 and >= 3 x first-10 mean |" in table
    assert "| control stays flat |" in table and "| control's trainer moves |" in table and "FAIL" not in table
    assert "| p2p | verl_p2p | 60 | 0.140 | 0.900 | x 0.000 -> 0.950 (steps 0, 60) |" in table
    assert (out / "learn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a control whose reward rises (the rollout learned without the sync) fails the run's goals
    rises = write_run(tmp_path / "ctl2", [0.001] * steps, paused=False, backend="control", rewards=rising)
    args = [str(p2p), str(moon), str(rises), "--names", "p2p,mooncake,control", "--out-dir", str(tmp_path / "o2")]
    assert grpo_report.main([*args, "--table", "table.txt", "--require-goals"]) == 1
    assert (
        "| control stays flat | |last-10 - first-10| <= 0.05 | 0.140 -> 0.900 | FAIL |"
        in (tmp_path / "o2" / "table.txt").read_text()
    )


def old_report() -> dict:
    """A report as grpo_report wrote it before phase/paused_s was read: `paused_s` held phase/total_s."""
    steps = [
        {"step": i, "sync_s": 1.0 + i / 100, "paused_s": 0.9 + i / 100, "push_s": 0.8, "bytes": 5.0, "reward_mean": 0.0}
        for i in (1, 2, 3)
    ]
    attempt = {"name": "x_p2p_failed", "steps": steps[:1], "steady_paused_s_median": None, "checks": {"ok": False}}
    return {
        "name": "x_p2p", "checks": {"ok": True}, "steps": steps, "steady_sync_s_median": 1.025,
        "steady_paused_s_median": 0.925, "earlier_attempts": [attempt],
    }  # fmt: skip


def test_a_report_from_before_paused_s_says_paused_was_not_recorded(tmp_path):
    """Its `paused_s` figures become the total column and the paused window is "not recorded", in its earlier
    attempts too; a migrated report migrates to itself."""
    (tmp_path / "x_p2p.json").write_text(json.dumps(old_report()))
    out = tmp_path / "out"
    args = [str(tmp_path / "x_p2p.json"), "--from-reports", "--out-dir", str(out), "--table", "t"]
    assert grpo_report.main(args) == 0
    rep = json.loads((out / "x_p2p.json").read_text())
    assert rep["backend"] == "verl_p2p" and rep["paused_s_note"].startswith("not recorded")
    assert [s["total_s"] for s in rep["steps"]] == [0.91, 0.92, 0.93]
    assert {s["paused_s"] for s in rep["steps"]} == {None}
    assert rep["steady_total_s_median"] == 0.925 and rep["steady_paused_s_median"] is None
    attempt = rep["earlier_attempts"][0]
    assert attempt["backend"] == "verl_p2p" and attempt["steps"][0]["total_s"] == 0.91
    assert attempt["steps"][0]["paused_s"] is None and "paused_s_note" not in attempt
    assert "| 1 | 1.010 | not recorded | 0.910 | 5 |" in (out / "t").read_text()
    again = tmp_path / "again"
    assert grpo_report.main([str(out / "x_p2p.json"), "--from-reports", "--out-dir", str(again)]) == 0
    assert json.loads((again / "x_p2p.json").read_text()) == rep


def test_the_committed_qwen3_4b_table_is_what_its_jsons_give(tmp_path):
    """docs/measurements' p2p-vs-mooncake table comes from its two JSONs as they are committed."""
    docs = ROOT / "docs" / "measurements"
    names = ["grpo_h200_one_step_off_qwen3_4b_p2p", "grpo_h200_one_step_off_qwen3_4b_mooncake"]
    reports = [str(docs / f"{n}.json") for n in names]
    assert grpo_report.main([*reports, "--from-reports", "--out-dir", str(tmp_path), "--table", "table.txt"]) == 0
    for name in names:  # already in the current form: regenerating changes nothing
        assert json.loads((tmp_path / f"{name}.json").read_text()) == json.loads((docs / f"{name}.json").read_text())
    table = (tmp_path / "table.txt").read_text()
    assert table in (ROOT / "docs/measurements/grpo_h200_one_step_off_qwen3_4b_p2p_vs_mooncake.md").read_text()
    assert "| 1 | 0.885 | not recorded | 0.882 | 2392810496 | 9.449 | - | - | - |" in table

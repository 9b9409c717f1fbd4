"""scripts/grpo_check.py summary: what the GPU run's JSON says is read from verl's own logs, and a run that missed a
step's p2p metrics, failed the weight check or differs from the fresh server is not ok."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("grpo_check", ROOT / "scripts" / "grpo_check.py")
grpo_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grpo_check)

CHECKED = (
    "(OneStepTaskRunner pid=7) INFO:verl_p2p.rollout.checker:check_weight_update_equal: compare passed on 1 replica(s)"
)


def console(step: int, p2p: bool = True) -> str:
    metrics = f"training/global_step:{step} - training/epoch:0 - actor/pg_loss:-0.01"
    if p2p:
        metrics += f" - checkpoint_engine/p2p/bytes:2886144.0 - checkpoint_engine/p2p/seconds/total:0.{step}"
    return f"(OneStepTaskRunner pid=7) step:{step} - {metrics}"


def run(tmp_path: Path, lines: list[str], equal: bool = True, rc: int = 0, jsonl: bool = False) -> dict:
    (tmp_path / "run.log").write_text("\n".join(lines) + "\n")
    if jsonl:
        rows = [
            {"step": s, "data": {"training/global_step": s, "checkpoint_engine/p2p/bytes": 1.0}} for s in (1, 2, 3, 4)
        ]
        (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "compare.json").write_text(json.dumps({"equal": equal, "version": "4"}))
    (tmp_path / "probe.json").write_text(json.dumps({"records": {"0": {}, "4": {}, "10": {}}}))
    args = [
        "summary", "--log", str(tmp_path / "run.log"), "--metrics", str(tmp_path / "metrics.jsonl"),
        "--probe", str(tmp_path / "probe.json"), "--compare", str(tmp_path / "compare.json"),
        "--steps", "4", "--rc", str(rc), "--out", str(tmp_path / "summary.json"),
    ]  # fmt: skip
    grpo_check.main(args)
    return json.loads((tmp_path / "summary.json").read_text())


def test_complete_run_is_ok_with_every_steps_p2p_metrics(tmp_path):
    s = run(
        tmp_path, ["step:0 - val-core/tiny_repeat/reward/mean@1:0.01", CHECKED] + [console(i) for i in (1, 2, 3, 4)]
    )
    assert s["ok"] and s["steps_completed"] == 4 and s["metrics_source"] == "console log"
    assert s["p2p_metrics"]["3"] == {
        "checkpoint_engine/p2p/bytes": 2886144.0,
        "checkpoint_engine/p2p/seconds/total": 0.3,
    }
    assert s["first_sync_weight_check"]["passed"] and s["rollout_versions_probed"] == ["0", "4", "10"]


def test_file_logger_is_preferred_over_console_lines(tmp_path):
    s = run(tmp_path, [CHECKED], jsonl=True)
    assert s["metrics_source"].endswith("metrics.jsonl") and s["ok"]


@pytest.mark.parametrize(
    "lines, equal, rc",
    [
        ([CHECKED] + [console(i, p2p=i != 2) for i in (1, 2, 3, 4)], True, 0),  # a step without sync metrics
        ([console(i) for i in (1, 2, 3, 4)], True, 0),  # no verdict of the weight check
        ([CHECKED, "WeightCheckError: check_weight_update_equal after the first sync: compare failed"], True, 1),
        ([CHECKED] + [console(i) for i in (1, 2, 3)], True, 0),  # stopped early
        ([CHECKED] + [console(i) for i in (1, 2, 3, 4)], False, 0),  # rollout differs from the fresh server
    ],
    ids=["missing-metrics", "no-check", "check-failed", "short", "greedy-differs"],
)
def test_incomplete_runs_are_not_ok(tmp_path, lines, equal, rc):
    assert run(tmp_path, lines, equal=equal, rc=rc)["ok"] is False

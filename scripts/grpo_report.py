"""Turn a GPU GRPO run (scripts/gpu_grpo_run.sh's $OUT: summary.json + metrics.jsonl, or their logs.tgz) into the
report of docs/measurements: one JSON per run (the command, every check's verdict, per-step sync figures) and a
PNG of reward and sync time per step; with several runs, a side-by-side table (markdown) and the sync-time ratio.

Per step: `sync_s` is verl's own timer around the weight sync (`timing_s/update_weights`), the same for every
backend; `paused_s` is the rollout's paused window as p2p's lifecycle measures it (abort .. resume,
`checkpoint_engine/p2p/phase/total_s`; absent for verl's own engines); `bytes` is what p2p wrote.
Per sync (`syncs`, from the run's "p2p sync to version N" log lines): p2p's own seconds and bytes of each weight
version. fully_async logs no sync figures in its training steps (the rollouter's syncs run beside them), so its
plot shows these, by version, and its report carries verl's per-step partial-rollout counts (`fully_async`).

Usage: grpo_report.py RUN_DIR [RUN_DIR ...] --names a,b --command "..." [--command ...] --out-dir docs/measurements
       [--device-seconds N ...] [--png]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tarfile
from pathlib import Path

SYNC = "timing_s/update_weights"
PAUSED = "checkpoint_engine/p2p/phase/total_s"
PUSH = "checkpoint_engine/p2p/phase/push_s"
BYTES = "checkpoint_engine/p2p/bytes"
REWARD = "critic/rewards/mean"
SYNC_TOTAL = "checkpoint_engine/p2p/seconds/total"


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """(summary, metrics rows) from a run's folder: plain files, or summary.json beside logs.tgz (PACK=1)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    text = ""
    if (run_dir / "metrics.jsonl").exists():
        text = (run_dir / "metrics.jsonl").read_text()
    elif (run_dir / "logs.tgz").exists():
        with tarfile.open(run_dir / "logs.tgz") as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("metrics.jsonl")), None)
            if member is not None:
                text = io.TextIOWrapper(tar.extractfile(member), encoding="utf-8").read()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return summary, rows


def per_step(rows: list[dict]) -> list[dict]:
    """One row per training step: the sync figures and the mean reward."""
    merged: dict[int, dict] = {}
    for row in rows:
        merged.setdefault(int(row["step"]), {}).update(row.get("data", {}))
    out = []
    for step, data in sorted(merged.items()):
        if "training/global_step" not in data:
            continue
        out.append(
            {
                "step": step,
                "sync_s": data.get(SYNC),
                "paused_s": data.get(PAUSED),
                "push_s": data.get(PUSH),
                "bytes": data.get(BYTES),
                "reward_mean": data.get(REWARD),
            }
        )
    return out


def syncs(summary: dict) -> list[dict]:
    """p2p's figures of each weight version it wrote, in version order (the summary's sync log lines)."""
    log = summary.get("p2p_sync_log") or {}
    order = sorted(log, key=lambda v: (0, int(v)) if str(v).isdigit() else (1, str(v)))
    return [{"version": v, "sync_s": log[v].get(SYNC_TOTAL), "bytes": log[v].get(BYTES)} for v in order]


def checks(summary: dict) -> dict:
    """Every verdict the run's summary holds, flat (what the report's reader looks for first)."""
    compare = summary.get("greedy_vs_fresh_server", {})
    return {
        "ok": summary.get("ok"),
        "steps_completed": summary.get("steps_completed"),
        "p2p_metrics_every_step": summary.get("p2p_metrics_every_step"),
        "first_sync_weight_check": summary.get("first_sync_weight_check", {}).get("verdict"),
        "rollout_versions_probed": summary.get("rollout_versions_probed"),
        "final_version_probed": summary.get("final_version_probed"),
        "fresh_server_greedy_equal": compare.get("greedy_equal"),
        "fresh_server_checksums_equal": compare.get("checksums_equal"),
        "checksums_compared": compare.get("checksums_compared"),
        "save_hook_lines": summary.get("save_hook_lines"),
    }


def median(values: list) -> float | None:
    known = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(known) if known else None


def report(name: str, summary: dict, rows: list[dict], command: str, device_s: float | None) -> dict:
    steps = per_step(rows)
    out = {
        "name": name,
        "command": command,
        "device_seconds": device_s,
        "mode": summary.get("mode"),
        "checks": checks(summary),
        "steps": steps,
        # the first sync carries the connect / plan / first-push check: steady state is the rest
        "steady_sync_s_median": median([s["sync_s"] for s in steps[1:]]),
        "steady_paused_s_median": median([s["paused_s"] for s in steps[1:]]),
        "syncs": syncs(summary),
    }
    if "fully_async" in summary:
        out["fully_async"] = summary["fully_async"]
    return out


def table(reports: list[dict]) -> str:
    """Per-step sync seconds, paused seconds and bytes, the runs side by side, and the steady-state ratio."""
    header = "| step | " + " | ".join(f"{r['name']} sync s | paused s | bytes" for r in reports) + " |"
    lines = [header, "|" + "---|" * (1 + 3 * len(reports))]
    steps = sorted({s["step"] for r in reports for s in r["steps"]})
    for step in steps:
        cells = []
        for r in reports:
            row = next((s for s in r["steps"] if s["step"] == step), {})
            cells += [_fmt(row.get("sync_s")), _fmt(row.get("paused_s")), _fmt(row.get("bytes"), 0)]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    if len(reports) >= 2 and reports[0]["steady_sync_s_median"] and reports[1]["steady_sync_s_median"]:
        ratio = reports[1]["steady_sync_s_median"] / reports[0]["steady_sync_s_median"]
        lines.append("")
        lines.append(
            f"steady-state sync (median of steps 2..): {reports[1]['name']} / {reports[0]['name']} = {ratio:.2f}"
        )
    return "\n".join(lines)


def _fmt(value, digits: int = 3) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:.{digits}f}" if digits else f"{int(value)}"


def plot(reports: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_reward, ax_sync) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in reports:
        steps = [s["step"] for s in r["steps"]]
        ax_reward.plot(steps, [s["reward_mean"] for s in r["steps"]], marker="o", label=r["name"])
        if any(isinstance(s["sync_s"], (int, float)) for s in r["steps"]):
            ax_sync.plot(steps, [s["sync_s"] for s in r["steps"]], marker="o", label=f"{r['name']} sync")
        elif r["syncs"]:  # no per-step sync timer (fully_async): p2p's own seconds of each numbered version
            numbered = [x for x in r["syncs"] if str(x["version"]).isdigit()]
            ax_sync.plot(
                [int(x["version"]) for x in numbered], [x["sync_s"] for x in numbered], marker="s",
                label=f"{r['name']} p2p sync (x: version)",
            )  # fmt: skip
        if any(isinstance(s["paused_s"], (int, float)) for s in r["steps"]):
            ax_sync.plot(steps, [s["paused_s"] for s in r["steps"]], marker="x", ls="--", label=f"{r['name']} paused")
    ax_reward.set(title="mean reward per step", xlabel="step", ylabel="reward")
    ax_sync.set(title="weight sync per step", xlabel="step", ylabel="seconds")
    for ax in (ax_reward, ax_sync):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (summary.json + metrics.jsonl or logs.tgz)")
    parser.add_argument("--names", required=True, help="comma-separated report names, one per run")
    parser.add_argument("--command", action="append", default=[], help="the command that made each run")
    parser.add_argument("--device-seconds", action="append", type=float, default=[])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--png", help="file name of the plot in --out-dir (all runs in one figure)")
    parser.add_argument("--table", help="file name of the side-by-side markdown table in --out-dir")
    args = parser.parse_args(argv)
    names = args.names.split(",")
    if len(names) != len(args.runs):
        parser.error("--names needs one name per run")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    reports = []
    for i, (name, run_dir) in enumerate(zip(names, args.runs, strict=True)):
        summary, rows = read_run(run_dir)
        command = args.command[i] if i < len(args.command) else ""
        device_s = args.device_seconds[i] if i < len(args.device_seconds) else None
        rep = report(name, summary, rows, command, device_s)
        (args.out_dir / f"{name}.json").write_text(json.dumps(rep, indent=2, sort_keys=True) + "\n")
        reports.append(rep)
    text = table(reports)
    print(text)
    if args.table:
        (args.out_dir / args.table).write_text(text + "\n")
    if args.png:
        plot(reports, args.out_dir / args.png)
    return 0 if all(r["checks"]["ok"] for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())

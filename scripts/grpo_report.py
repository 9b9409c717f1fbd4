"""Turn a GPU GRPO run (scripts/gpu_grpo_run.sh's $OUT: summary.json + metrics.jsonl, or their logs.tgz) into the
report of docs/measurements: one JSON per run (the command, its backend, every check's verdict, per-step reward and
sync figures) and a PNG of reward and sync time per step; with several runs, a side-by-side table (markdown): the
per-run reward summary (first-10 and last-10 step means) and issue 34's learning goals, then the per-step figures.

Per step: `sync_s` is verl's own timer around the weight sync (`timing_s/update_weights`), the same for every
backend; `paused_s` is the rollout's paused window as p2p's lifecycle measures it (abort .. resume,
`checkpoint_engine/p2p/phase/paused_s`; absent for verl's own engines); `total_s` is p2p's whole sync
(`phase/total_s`: connect and prepare, which run before the abort, plus the paused window); `bytes` is what p2p
wrote. Per run: `backend` is `verl_p2p`, `mooncake`, `control` (the negative control's no-op engine,
recipes/learn/control_engine.py) or another verl engine, from the run's summary.
Per sync (`syncs`, from the run's "p2p sync to version N" log lines): p2p's own seconds and bytes of each weight
version. fully_async logs no sync figures in its training steps (the rollouter's syncs run beside them), so its
plot shows these, by version, and its report carries verl's per-step partial-rollout counts (`fully_async`).

Usage: grpo_report.py RUN_DIR [RUN_DIR ...] --names a,b --command "..." [--command ...] --out-dir docs/measurements
       [--device-seconds N ...] [--table TABLE] [--png P.png] [--require-goals]
       grpo_report.py REPORT.json [...] --from-reports --out-dir DIR [--table ...] [--png ...]   (reports on file)
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

SYNC = "timing_s/update_weights"
PAUSED = "checkpoint_engine/p2p/phase/paused_s"
TOTAL = "checkpoint_engine/p2p/phase/total_s"
PUSH = "checkpoint_engine/p2p/phase/push_s"
BYTES = "checkpoint_engine/p2p/bytes"
REWARD = "critic/rewards/mean"
KL_LOSS = "actor/kl_loss"  # the actor's KL to the reference (its start): grows as the trainer's weights move
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
                "total_s": data.get(TOTAL),
                "push_s": data.get(PUSH),
                "bytes": data.get(BYTES),
                "reward_mean": data.get(REWARD),
                "kl_loss": data.get(KL_LOSS),
            }
        )
    return out


def validation(rows: list[dict]) -> dict | None:
    """verl's validation scores (`val-core/...`) at the first and the last step that logged them (before training:
    step 0): issue 34 asks for them at the start and the end."""
    by_step: dict[int, dict] = {}
    for row in rows:
        scores = {k: v for k, v in row.get("data", {}).items() if k.startswith("val-core/")}
        if scores:
            by_step.setdefault(int(row["step"]), {}).update(scores)
    logged = sorted(by_step.items())
    if not logged:
        return None
    (first, at_first), (last, at_last) = logged[0], logged[-1]
    return {"start": {"step": first, "metrics": at_first}, "end": {"step": last, "metrics": at_last}}


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


def backend_of(summary: dict) -> str:
    """The run's weight-sync backend by its registered name (gpu_grpo_run.sh's summaries say `p2p` for this
    package's)."""
    backend = summary.get("backend") or "p2p"
    return "verl_p2p" if backend == "p2p" else backend


def report(name: str, summary: dict, rows: list[dict], command: str, device_s: float | None) -> dict:
    steps = per_step(rows)
    out = {
        "name": name,
        "command": command,
        "device_seconds": device_s,
        "mode": summary.get("mode"),
        "backend": backend_of(summary),
        "checks": checks(summary),
        "steps": steps,
        # the first sync carries the connect / plan / first-push check: steady state is the rest
        "steady_sync_s_median": median([s["sync_s"] for s in steps[1:]]),
        "steady_paused_s_median": median([s["paused_s"] for s in steps[1:]]),
        "steady_total_s_median": median([s.get("total_s") for s in steps[1:]]),
        "reward": reward_summary(steps),
        "validation": validation(rows),
        "syncs": syncs(summary),
    }
    if "fully_async" in summary:
        out["fully_async"] = summary["fully_async"]
    return out


WINDOW = 10  # issue 34's first-10 / last-10 step means


def mean(values: list) -> float | None:
    known = [v for v in values if isinstance(v, (int, float))]
    return statistics.fmean(known) if known else None


def reward_summary(steps: list[dict]) -> dict:
    """The mean reward of the first and the last WINDOW training steps (fewer steps: all of them, both ends)."""
    rewards = [s["reward_mean"] for s in steps if isinstance(s.get("reward_mean"), (int, float))]
    return {"steps": len(rewards), "first10_mean": mean(rewards[:WINDOW]), "last10_mean": mean(rewards[-WINDOW:])}


@dataclass(frozen=True)
class Goal:
    """One of issue 34's goals: what it asks, the figures it was computed from, and whether they meet it."""

    name: str
    wanted: str
    measured: str
    passed: bool


def rises(r: dict) -> Goal:
    first, last = r["reward"]["first10_mean"], r["reward"]["last10_mean"]
    ok = first is not None and last is not None and last >= 0.5 and last >= 3 * first
    return Goal(
        f"{r['name']} learns", "last-10 mean >= 0.5 and >= 3 x first-10 mean", f"{_fmt(first)} -> {_fmt(last)}", ok
    )


def goals(reports: list[dict]) -> list[Goal]:
    """Issue 34's goals over the runs given, by backend: each learning run (verl_p2p, mooncake) rises; p2p's and verl's
    engine's last-10 means within 0.1 (the first run of each); the negative control stays within 0.05 of its start
    while its trainer moves (the actor's KL to its reference grows).
    Only runs of at least two windows of steps are judged: in a shorter run the first and last 10 overlap."""
    by_backend: dict[str, list[dict]] = {}
    for r in (r for r in reports if r["reward"]["steps"] >= 2 * WINDOW):
        by_backend.setdefault(r["backend"], []).append(r)
    out = [rises(r) for b in ("verl_p2p", "mooncake") for r in by_backend.get(b, [])]
    if by_backend.get("verl_p2p") and by_backend.get("mooncake"):
        a, b = by_backend["verl_p2p"][0], by_backend["mooncake"][0]
        la, lb = a["reward"]["last10_mean"], b["reward"]["last10_mean"]
        ok = la is not None and lb is not None and abs(la - lb) <= 0.1
        out.append(Goal(f"{a['name']} ~ {b['name']}", "last-10 means within 0.1", f"{_fmt(la)} vs {_fmt(lb)}", ok))
    for r in by_backend.get("control", []):
        first, last = r["reward"]["first10_mean"], r["reward"]["last10_mean"]
        ok = first is not None and last is not None and abs(last - first) <= 0.05
        out.append(
            Goal(f"{r['name']} stays flat", "|last-10 - first-10| <= 0.05", f"{_fmt(first)} -> {_fmt(last)}", ok)
        )
        kl = [s.get("kl_loss") for s in r["steps"]]
        kl_first, kl_last = mean(kl[:WINDOW]), mean(kl[-WINDOW:])
        moved = kl_first is not None and kl_last is not None and kl_last > kl_first
        wanted = "actor/kl_loss last-10 mean > first-10 mean"
        out.append(Goal(f"{r['name']}'s trainer moves", wanted, f"{_fmt(kl_first, 5)} -> {_fmt(kl_last, 5)}", moved))
    return out


def paused_recorded(r: dict) -> bool:
    """Whether the run's steps carry p2p's paused window (verl's own engines have none: their sync is the pause)."""
    return any(isinstance(s.get("paused_s"), (int, float)) for s in r["steps"])


def _paused_cell(r: dict, value) -> str:
    if r["backend"] == "verl_p2p" and not paused_recorded(r):
        return "not recorded"
    return _fmt(value)


def _validation_cell(val: dict | None) -> str:
    """The first val-core metric (by name) at the start and the end, e.g. `acc/mean@1 0.031 -> 0.998 (steps 0, 60)`."""
    if not val or not val["start"]["metrics"]:
        return "-"
    key = sorted(val["start"]["metrics"])[0]
    end = val["end"]["metrics"].get(key)
    return (
        f"{key.split('/', 2)[-1]} {_fmt(val['start']['metrics'][key])} -> {_fmt(end)} "
        f"(steps {val['start']['step']}, {val['end']['step']})"
    )


def summary_table(reports: list[dict]) -> str:
    """Per run: backend, steps, first-10 and last-10 mean reward, steady sync / paused / total seconds."""
    lines = [
        "| run | backend | steps | reward first-10 | reward last-10 | validation start -> end | sync s | paused s "
        "| total s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        rew = r["reward"]
        lines.append(
            f"| {r['name']} | {r['backend']} | {rew['steps']} | {_fmt(rew['first10_mean'])} | "
            f"{_fmt(rew['last10_mean'])} | {_validation_cell(r.get('validation'))} | "
            f"{_fmt(r['steady_sync_s_median'])} | {_paused_cell(r, r['steady_paused_s_median'])} | "
            f"{_fmt(r.get('steady_total_s_median'))} |"
        )
    return "\n".join(lines)


def goals_table(found: list[Goal]) -> str:
    lines = ["| goal (issue 34) | wanted | measured | verdict |", "|---|---|---|---|"]
    lines += [f"| {g.name} | {g.wanted} | {g.measured} | {'pass' if g.passed else 'FAIL'} |" for g in found]
    return "\n".join(lines)


def table(reports: list[dict]) -> str:
    """The per-run summary, the goals that apply, then per-step sync, paused and total seconds and bytes side by
    side, and the steady-state sync ratio of the first two runs."""
    parts = [summary_table(reports)]
    found = goals(reports)
    if found:
        parts.append(goals_table(found))
    header = "| step | " + " | ".join(f"{r['name']} sync s | paused s | total s | bytes" for r in reports) + " |"
    lines = [header, "|" + "---|" * (1 + 4 * len(reports))]
    steps = sorted({s["step"] for r in reports for s in r["steps"]})
    for step in steps:
        cells = []
        for r in reports:
            row = next((s for s in r["steps"] if s["step"] == step), {})
            cells += [
                _fmt(row.get("sync_s")),
                _paused_cell(r, row.get("paused_s")),
                _fmt(row.get("total_s")),
                _fmt(row.get("bytes"), 0),
            ]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    if len(reports) >= 2 and reports[0]["steady_sync_s_median"] and reports[1]["steady_sync_s_median"]:
        ratio = reports[1]["steady_sync_s_median"] / reports[0]["steady_sync_s_median"]
        lines.append("")
        lines.append(
            f"steady-state sync (median of steps 2..): {reports[1]['name']} / {reports[0]['name']} = {ratio:.2f}"
        )
    parts.append("\n".join(lines))
    return "\n\n".join(parts)


PAUSED_NOT_RECORDED = (
    "not recorded: this report was written when its paused_s held p2p's phase/total_s (connect and prepare before "
    "the abort, then the paused window); that figure is total_s now, and 'paused' in its what_happened texts means it"
)


def migrate(rep: dict, backend: str | None = None) -> dict:
    """A report JSON written before `paused_s` was read from `phase/paused_s` (it has no `steady_total_s_median`):
    its steps' `paused_s` held p2p's `phase/total_s`; they move to `total_s` and the paused window becomes
    unrecorded (None), in its earlier attempts too. The backend comes from the name's last word (`..._p2p`)."""
    if "steady_total_s_median" in rep:
        return rep
    rep = dict(rep)
    rep["steps"] = [{**s, "total_s": s.get("paused_s"), "paused_s": None} for s in rep.get("steps", [])]
    rep["steady_total_s_median"] = rep.get("steady_paused_s_median")
    rep["steady_paused_s_median"] = None
    rep.setdefault("backend", backend or backend_of({"backend": rep.get("name", "").rsplit("_", 1)[-1]}))
    rep["reward"] = reward_summary(rep["steps"])
    if backend is None and any(isinstance(s["total_s"], (int, float)) for s in rep["steps"]):
        rep["paused_s_note"] = PAUSED_NOT_RECORDED
    if "earlier_attempts" in rep:
        rep["earlier_attempts"] = [migrate(a, rep["backend"]) for a in rep["earlier_attempts"]]
    return rep


def _fmt(value, digits: int = 3) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:.{digits}f}" if digits else f"{int(value)}"


def plot(reports: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_reward, ax_sync) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, r in enumerate(reports):
        color = f"C{i}"  # one colour per run in both panels
        steps = [s["step"] for s in r["steps"]]
        ax_reward.plot(steps, [s["reward_mean"] for s in r["steps"]], marker="o", color=color, label=r["name"])
        if any(isinstance(s["sync_s"], (int, float)) for s in r["steps"]):
            ax_sync.plot(steps, [s["sync_s"] for s in r["steps"]], marker="o", color=color, label=f"{r['name']} sync")
        elif r["syncs"]:  # no per-step sync timer (fully_async): p2p's own seconds of each numbered version
            numbered = [x for x in r["syncs"] if str(x["version"]).isdigit()]
            ax_sync.plot(
                [int(x["version"]) for x in numbered], [x["sync_s"] for x in numbered], marker="s", color=color,
                label=f"{r['name']} p2p sync (x: version)",
            )  # fmt: skip
        if any(isinstance(s["paused_s"], (int, float)) for s in r["steps"]):
            ax_sync.plot(
                steps,
                [s["paused_s"] for s in r["steps"]],
                marker="x",
                ls="--",
                color=color,
                label=f"{r['name']} paused",
            )
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
    parser.add_argument("--names", help="comma-separated report names, one per run (required for run folders)")
    parser.add_argument("--command", action="append", default=[], help="the command that made each run")
    parser.add_argument("--device-seconds", action="append", type=float, default=[])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--png", help="file name of the plot in --out-dir (all runs in one figure)")
    parser.add_argument("--table", help="file name of the side-by-side markdown table in --out-dir")
    parser.add_argument(
        "--from-reports", action="store_true",
        help="the arguments are report JSONs written earlier (a report from before phase/paused_s is migrated)",
    )  # fmt: skip
    parser.add_argument("--require-goals", action="store_true", help="exit 1 unless every issue-34 goal passes")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    reports = []
    if args.from_reports:
        for path in args.runs:
            rep = migrate(json.loads(path.read_text()))
            (args.out_dir / f"{rep['name']}.json").write_text(json.dumps(rep, indent=2, sort_keys=True) + "\n")
            reports.append(rep)
    else:
        names = (args.names or "").split(",")
        if not args.names or len(names) != len(args.runs):
            parser.error("--names needs one name per run folder")
        for i, (name, run_dir) in enumerate(zip(names, args.runs, strict=True)):
            summary, rows = read_run(run_dir)
            command = args.command[i] if i < len(args.command) else ""
            device_s = args.device_seconds[i] if i < len(args.device_seconds) else None
            rep = report(name, summary, rows, command, device_s)
            (args.out_dir / f"{name}.json").write_text(json.dumps(rep, indent=2, sort_keys=True) + "\n")
            reports.append(rep)
    text = table(reports)
    print(text)
    found = goals(reports)
    if found:
        print(json.dumps({"goals": [asdict(g) for g in found]}, indent=1))
    if args.table:
        (args.out_dir / args.table).write_text(text + "\n")
    if args.png:
        plot(reports, args.out_dir / args.png)
    ok = all(r["checks"]["ok"] for r in reports)
    if args.require_goals:
        ok = ok and bool(found) and all(g.passed for g in found)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

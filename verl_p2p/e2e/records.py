"""The e2e harness's record of one sync, the report's pause and raw-replay figures (issue 18's goals) and its
console form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_p2p.e2e.checks import Check


@dataclass
class SyncRecord:
    index: int
    version: str
    weights: int
    drill: str | None
    outcome: str  # "ok" | "failed" (a drill's expected failure, or a real one)
    error: str = ""
    phases: dict[str, float] = field(default_factory=dict)
    push: dict[str, Any] = field(default_factory=dict)
    paused_s: float = 0.0
    checks: list[Check] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)


def paused_seconds(phases: dict[str, float]) -> float:
    """How long the sync held the rollout paused, less the check_weight_update_equal steps it was asked for."""
    return phases.get("paused", 0.0) - phases.get("check_arm", 0.0) - phases.get("check_compare", 0.0)


def median(values: list[float]) -> float | None:
    """The middle value; of an even count the upper of the two (the conservative side for a ratio goal)."""
    values = sorted(values)
    return values[len(values) // 2] if values else None


def pause_and_raw_figures(records: list[SyncRecord]) -> dict[str, Any]:
    """Issue 18's figures: paused seconds of the first sync (less the weights checker's steps), of the first sync
    after a trainer restart and of the steady-state syncs, their ratios (goal <= 1.5), and each raw-replay sync's
    push beside raw Mooncake writes of the same write lists (goal <= 1.25)."""
    ok = [r for r in records if r.outcome == "ok"]
    first = ok[0] if ok and ok[0].index == 0 else None
    restarted = [r for r in ok if r.notes.get("first_after_trainer_restart")]
    steady = [
        r.paused_s
        for r in ok
        if r is not first
        and not r.drill
        and not r.notes.get("raw_replay")
        and r not in restarted
        and not r.notes.get("replanned_in_pause")
    ]
    steady_s = median(steady)
    raw = [r.push for r in ok if r.notes.get("raw_replay") and "raw_seconds" in r.push]
    out: dict[str, Any] = {
        "first_sync_paused_s": first.paused_s if first else None,
        "first_after_trainer_restart_paused_s": restarted[0].paused_s if restarted else None,
        "steady_state_paused_s": steady,
        "steady_state_paused_median_s": steady_s,
        "push_vs_raw": [
            {k: p[k] for k in ("seconds", "raw_seconds", "push_over_raw", "push_over_raw_less_export", "bytes")}
            for p in raw
        ],
        "push_over_raw_median": median([p["push_over_raw"] for p in raw]),
        "push_over_raw_less_export_median": median([p["push_over_raw_less_export"] for p in raw]),
        "goals": {"paused_over_steady": 1.5, "push_over_raw": 1.25},
    }
    if steady_s:
        if first is not None:
            out["first_over_steady"] = first.paused_s / steady_s
        if restarted:
            out["restart_over_steady"] = restarted[0].paused_s / steady_s
    return out


def summary_text(results: dict[str, Any]) -> str:
    """The report's console form: per model its syncs, their checks, the pause and raw-replay figures."""
    lines = []
    for arch, r in results.items():
        lines.append(
            f"{arch}: {'PASS' if r.get('passed') else 'FAIL'}  push {r.get('push_bytes')} B, "
            f"median {r.get('push_gbps_median')} GB/s"
        )
        for s in r.get("syncs", []):
            bad = [c["name"] for c in s["checks"] if not c["ok"]]
            lines.append(
                f"  sync {s['index']} weights {s['weights']} drill {s['drill'] or '-':13s} {s['outcome']:6s} "
                f"paused {s['paused_s']:.3f}s  {'checks ok' if not bad else 'FAILED ' + ','.join(bad)}"
                + (f"  error: {s['error'][:160]}" if s["error"] else "")
            )
        f = r.get("figures") or {}
        if f:
            lines.append(
                f"  paused: first {f.get('first_sync_paused_s')} s, after trainer restart "
                f"{f.get('first_after_trainer_restart_paused_s')} s, steady median "
                f"{f.get('steady_state_paused_median_s')} s (first/steady {f.get('first_over_steady')}, "
                f"restart/steady {f.get('restart_over_steady')}; goal 1.5); push/raw "
                f"{f.get('push_over_raw_median')} (less export {f.get('push_over_raw_less_export_median')}; goal 1.25)"
            )
        if r.get("error"):
            lines.append("  ERROR: " + r["error"].strip().splitlines()[-1])
    return "\n".join(lines)

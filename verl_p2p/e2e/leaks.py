"""Resource samples of the soaks' processes and the judgement of their growth (one copy for both soaks).

A soak that leaks must fail, not only print a slope: after the warm-up, the least-squares growth per 100 syncs of
a process's RSS, open fds or threads must stay within its limit. A restarted process (a new trainer or server, an
engine that rejoined with new connections) starts a new instance with its own intercept and its own warm-up, so
a step at a restart is not read as growth. A slope alone over a short run is mostly noise, so growth counts as a
leak only when the fitted growth over the judged syncs also passes a floor (`LeakLimit.floor`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def proc_resources(pid: int | str = "self") -> dict[str, float] | None:
    """RSS (MB), threads and open fds of one process; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024.0, "threads": int(fields["Threads"]), "fds": fds}


def _judged_points(samples: Sequence[Mapping[str, Any]], key: str, warmup: int) -> dict[Any, list[tuple[int, float]]]:
    """(sync, value) per process instance, the first `warmup` syncs of every instance left out."""
    groups: dict[Any, list[tuple[int, float]]] = {}
    for s in samples:
        start = s.get("instance_start", 0)
        if s.get(key) is not None and s["sync"] - start >= warmup:
            groups.setdefault(s.get("instance", 0), []).append((s["sync"], float(s[key])))
    return groups


def slope_per_100(samples: Sequence[Mapping[str, Any]], key: str, warmup: int) -> float | None:
    """Least-squares slope of `key` per 100 syncs, pooled within process instances (each its own intercept),
    leaving out the first `warmup` syncs of every instance. None when too few samples."""
    num = den = 0.0
    for points in _judged_points(samples, key, warmup).values():
        if len(points) < 2:
            continue
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        num += sum((x - mx) * (y - my) for x, y in points)
        den += sum((x - mx) ** 2 for x, _ in points)
    return round(100.0 * num / den, 4) if den else None


def judged_syncs(samples: Sequence[Mapping[str, Any]], key: str, warmup: int) -> int:
    """How many syncs the slope spans, summed over instances (the fitted growth is slope x this / 100)."""
    return sum(max(x for x, _ in p) - min(x for x, _ in p) for p in _judged_points(samples, key, warmup).values())


@dataclass(frozen=True)
class LeakLimit:
    """Growth of one resource that counts as a leak: more than `per_100_syncs` per 100 syncs after the warm-up,
    and more than `floor` in all over the judged syncs."""

    per_100_syncs: float
    floor: float


@dataclass(frozen=True)
class LeakLimits:
    """The soaks' leak limits (`verl-p2p soak --leak-rss-mb-per-100 / --leak-fds-per-100 /
    --leak-threads-per-100`); docs/failures.md says why these values."""

    rss_mb: LeakLimit = field(default_factory=lambda: LeakLimit(20.0, 16.0))
    fds: LeakLimit = field(default_factory=lambda: LeakLimit(10.0, 8.0))
    threads: LeakLimit = field(default_factory=lambda: LeakLimit(5.0, 4.0))

    def items(self) -> list[tuple[str, LeakLimit]]:
        return [("rss_mb", self.rss_mb), ("fds", self.fds), ("threads", self.threads)]


def judge_leaks(
    samples: Mapping[str, Sequence[Mapping[str, Any]]], warmup: int, limits: LeakLimits
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each process's slopes per 100 syncs after warm-up (rss_mb, fds, threads) and the leaks among them, as
    sentences naming the process, the resource, the slope and the limit (empty: none)."""
    slopes: dict[str, dict[str, Any]] = {}
    leaks: list[str] = []
    for who, rows in samples.items():
        slopes[who] = {}
        for key, limit in limits.items():
            slope = slope_per_100(rows, key, warmup)
            slopes[who][f"{key}_per_100_syncs"] = slope
            if slope is None:
                continue
            grown = slope * judged_syncs(rows, key, warmup) / 100.0
            if slope > limit.per_100_syncs and grown > limit.floor:
                leaks.append(
                    f"{who} {key} grows {slope:+.3f} per 100 syncs after warm-up ({grown:+.2f} over the judged "
                    f"syncs): past the limit of {limit.per_100_syncs} per 100 syncs (and {limit.floor} in all)"
                )
    return slopes, leaks

"""One key set per sync under `checkpoint_engine/p2p/`: bytes, GB/s and per-phase seconds over all sources.

Each trainer rank measures its own push (push.PushMetrics); the ranks' numbers are combined so that exactly one
rank hands verl the sync's metrics: bytes and counts add up, seconds and peaks are the slowest/largest rank's,
and GB/s is the total bytes over the slowest rank's push time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

PREFIX = "checkpoint_engine/p2p/"
_RATE = "gbps"


def as_dict(metrics: Any) -> dict[str, float]:
    """One rank's metrics as flat numbers: PushMetrics.to_dict(prefix=""), an `as_dict()`, a dataclass or a
    mapping; nested mappings become `key/sub`; non-numbers are dropped."""
    if metrics is None:
        return {}
    if hasattr(metrics, "to_dict"):
        raw = metrics.to_dict(prefix="")
    elif hasattr(metrics, "as_dict"):
        raw = metrics.as_dict()
    elif dataclasses.is_dataclass(metrics):
        raw = dataclasses.asdict(metrics)
    else:
        raw = dict(metrics)
    flat: dict[str, float] = {}
    for key, value in raw.items():
        if isinstance(value, Mapping):
            for sub, v in value.items():
                if _number(v):
                    flat[f"{key}/{sub}"] = float(v)
        elif _number(value):
            flat[str(key)] = float(value)
    return flat


def combine(per_rank: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Seconds and peaks: the largest rank's; rates: dropped (recomputed); everything else: the sum."""
    out: dict[str, float] = {}
    ranks = [r for r in per_rank if r]
    for rank in ranks:
        for key, value in rank.items():
            if key == _RATE:
                continue
            if _is_max(key):
                out[key] = max(out.get(key, 0.0), value)
            else:
                out[key] = out.get(key, 0.0) + value
    out["sources"] = float(len(ranks))
    return out


def sync_metrics(per_rank: Iterable[Mapping[str, float]], extra: Mapping[str, float] | None = None) -> dict:
    """The sync's metrics under PREFIX, GB/s from the total bytes over the slowest rank's push."""
    out = combine(per_rank)
    seconds = out.get("seconds/total", 0.0)
    if seconds > 0 and "bytes" in out:
        out[_RATE] = out["bytes"] / seconds / 1e9
    out.update(extra or {})
    return {PREFIX + key: value for key, value in sorted(out.items())}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_max(key: str) -> bool:
    return key.startswith(("seconds", "peak_")) or key.endswith("_s") or "/seconds" in key

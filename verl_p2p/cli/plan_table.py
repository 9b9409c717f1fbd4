"""The per-source table of `verl-p2p plan`, with runs of alike sources folded into one line.

A large trainer (Kimi-K2 at 256 GPUs) has hundreds of sources that differ only in which target they write:
printed one per line they bury the few lines that matter. Sources that send the same bytes, in the same number
of parts, with the same times, next to each other, fold into "sources 0-255 (256 alike): ...".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from verl_p2p.planning.sync_estimate import SourceEstimate

HEADER = f"{'source':>6} {'stage':>5} {'wire':>9} {'convert':>9} {'wire s':>7} {'conv s':>7} {'pred s':>7}  links"


@dataclass(frozen=True)
class SourceRun:
    """Consecutive sources whose rows are alike apart from their rank and the targets they write."""

    sources: tuple[SourceEstimate, ...]

    @property
    def first(self) -> SourceEstimate:
        return self.sources[0]

    @property
    def last(self) -> SourceEstimate:
        return self.sources[-1]


def _alike_key(s: SourceEstimate) -> tuple:
    """What two sources must share to fold: everything the row shows except rank, target names, part index."""
    parts = s.parts or ((0, 1),) * len(s.links)
    return (
        s.pp_stage,
        s.convert_bytes,
        round(s.wire_s, 3),
        round(s.convert_s, 3),
        round(s.predicted_s, 3),
        tuple((n, k) for (_, n), (_, k) in zip(s.links, parts, strict=True)),
    )


def source_runs(sources: tuple[SourceEstimate, ...] | list[SourceEstimate]) -> list[SourceRun]:
    runs: list[list[SourceEstimate]] = []
    for s in sources:
        if runs and runs[-1][-1].rank + 1 == s.rank and _alike_key(runs[-1][-1]) == _alike_key(s):
            runs[-1].append(s)
        else:
            runs.append([s])
    return [SourceRun(tuple(r)) for r in runs]


def links_text(s: SourceEstimate, size: Callable[[int], str]) -> str:
    parts = s.parts or ((0, 1),) * len(s.links)
    return (
        " ".join(
            f"e{t.engine}r{t.rank}{f'[{i + 1}/{k}]' if k > 1 else ''}:{size(n)}"
            for (t, n), (i, k) in zip(s.links, parts, strict=True)
        )
        or "(idle)"
    )


def source_lines(sources: tuple[SourceEstimate, ...], size: Callable[[int], str]) -> list[str]:
    """The table's rows: one per source, or one per run of alike sources."""
    lines = []
    for run in source_runs(sources):
        s = run.first
        numbers = (
            f"{s.pp_stage:>5} {size(s.wire_bytes):>9} {size(s.convert_bytes):>9} "
            f"{s.wire_s:>7.3f} {s.convert_s:>7.3f} {s.predicted_s:>7.3f}"
        )
        if len(run.sources) == 1:
            lines.append(f"{s.rank:>6} {numbers}  {links_text(s, size)}")
            continue
        count = len(run.sources)
        lines.append(
            f"sources {s.rank}-{run.last.rank} ({count} alike):\n{'':>6} {numbers}  "
            f"source {s.rank}: {links_text(s, size)} ... source {run.last.rank}: {links_text(run.last, size)}"
        )
    return lines

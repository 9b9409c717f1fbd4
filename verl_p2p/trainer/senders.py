"""Who exports and who writes: a rank's pipeline stage, the stage's ranks, and its senders.

A stage's export runs TP/EP gathers, which are collectives over ranks of that stage. The plan names only a
few of them as senders (there may be fewer rollout targets than trainer ranks), but every rank of the stage
must still run the export to the end, or the senders' gathers wait forever. `drive_export` does exactly that:
senders get the stream, the others drain it.

The same holds when something goes wrong. A rank that finds a problem before exporting (a plan it cannot
apply, a target whose published weights disagree) must not simply raise: its peers would enter the export
and wait in a gather for it. So every rank of the export group first agrees on go/no-go (`agree_to_export`:
one small all_gather over a gloo group of exactly the ranks whose collectives the export runs); when any rank
says no, every rank raises `ExportAbortedError` naming each failed rank and its cause, and none exports. A
rank that fails while streaming keeps draining the export to its end (`drain`), so its peers' collectives
still match, and raises afterwards.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl_p2p.errors import P2PError
from verl_p2p.planning.plan import SourceRank, TransferPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportStage:
    """One rank's place in the export: its PP stage, every global rank of that stage, and the stage's senders."""

    rank: int
    pp_rank: int
    pp_size: int
    ranks: tuple[int, ...]
    senders: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.rank not in self.ranks:
            raise P2PError(f"rank {self.rank} is not in its own stage's ranks {list(self.ranks)}")
        stray = sorted(set(self.senders) - set(self.ranks))
        if stray:
            raise P2PError(f"senders {stray} are not ranks of pipeline stage {self.pp_rank} {list(self.ranks)}")

    @property
    def is_sender(self) -> bool:
        return self.rank in self.senders


def local_source() -> SourceRank:
    """This rank as a plan source, from Megatron's parallel state (no communication)."""
    from megatron.core import parallel_state as mpu

    return SourceRank(global_rank=torch.distributed.get_rank(), pp_stage=mpu.get_pipeline_model_parallel_rank())


def gather_sources(group: torch.distributed.ProcessGroup | None = None) -> list[SourceRank]:
    """Every trainer rank's `SourceRank`, by one all_gather_object over `group` (setup time, once)."""
    mine = local_source()
    gathered: list[SourceRank | None] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, mine, group=group)
    return sorted(s for s in gathered if s is not None)


def stage_of(rank: int, sources: Sequence[SourceRank], senders: Iterable[int] | TransferPlan) -> ExportStage:
    """`rank`'s stage among `sources`; `senders` are the ranks that write (or a plan, whose senders those are)."""
    by_rank = {s.global_rank: s for s in sources}
    if rank not in by_rank:
        raise P2PError(f"rank {rank} is not among the export sources {sorted(by_rank)}")
    stage = by_rank[rank].pp_stage
    ranks = tuple(sorted(s.global_rank for s in sources if s.pp_stage == stage))
    writing = set(senders.senders() if isinstance(senders, TransferPlan) else senders)
    return ExportStage(
        rank=rank,
        pp_rank=stage,
        pp_size=len({s.pp_stage for s in sources}),
        ranks=ranks,
        senders=tuple(r for r in ranks if r in writing),
    )


def drive_export(stage: ExportStage, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Senders: yield the stage's stream. Others: run it to the end and yield nothing (their collectives match).

    Every rank of the stage calls this for every sync, including stages whose plan has no sender at all (the
    fallback export's collectives span stages, so no stage may skip it).
    """
    if stage.is_sender:
        yield from stream
        return
    for _name, _tensor in stream:
        pass


# ---- go/no-go --------------------------------------------------------------------------------------------------


class ExportAbortedError(P2PError):
    """A rank of the export group could not export or write: no rank of the group entered the export.

    `failures`: `{trainer rank: "ErrorType: message"}` of every rank that said no; raised on every rank of the
    group alike (chained from the local error on the ranks that failed).
    """

    def __init__(self, group: Sequence[int], failures: Mapping[int, str]):
        self.group = tuple(group)
        self.failures = dict(failures)
        causes = "\n  ".join(f"trainer rank {rank}: {why}" for rank, why in sorted(self.failures.items()))
        super().__init__(
            f"p2p export aborted before any of trainer ranks {list(self.group)} exported or wrote a byte: "
            f"{len(self.failures)} rank(s) refused:\n  {causes}"
        )


_groups: dict[tuple[int, ...], Any] = {}
_groups_lock = threading.Lock()


def export_group(ranks: Sequence[int] | None) -> Any:
    """The gloo group the go/no-go runs on: `ranks` (a stage), or every rank (None: the full export crosses
    stages). Made once per rank set; only its members take part in making it (local synchronisation)."""
    import torch.distributed as dist

    key = tuple(sorted(ranks)) if ranks is not None else ()
    with _groups_lock:
        if key not in _groups:
            if ranks is None:
                _groups[key] = dist.new_group(backend="gloo")
            else:
                _groups[key] = dist.new_group(ranks=list(key), backend="gloo", use_local_synchronization=True)
        return _groups[key]


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def agree_to_export(
    rank: int, ranks: Sequence[int] | None, error: BaseException | None, stream_digest: str | None = None
) -> None:
    """Go/no-go over the export group: return when every rank is ready; otherwise raise ExportAbortedError on
    every rank, naming each rank that failed and why (chained from `error` on a rank that failed itself).

    `ranks`: the export group (this rank's stage for a stage-local export; None for every rank). Every rank of
    the group must call it once per sync, before its first export collective. `stream_digest`: the digest of
    the stream this rank will iterate, where every rank of the group iterates the same one (FSDP's full-tensor
    stream): ranks whose digest differs from the others' are refused, since their gathers would not match.
    """
    import torch.distributed as dist

    mine = (rank, None if error is None else describe(error), stream_digest)
    if not (dist.is_available() and dist.is_initialized()):
        alone = True
    else:
        alone = len(set(ranks)) <= 1 if ranks is not None else dist.get_world_size() == 1
    if alone:
        verdicts: list[Any] = [mine]
    else:
        group = export_group(ranks)
        verdicts = [None] * dist.get_world_size(group)
        dist.all_gather_object(verdicts, mine, group=group)
    failures = {r: why for r, why, _ in verdicts if why is not None}
    for r, why in disagreeing_streams({r: d for r, _, d in verdicts if d is not None}).items():
        failures.setdefault(r, why)
    if failures:
        raise ExportAbortedError(sorted(r for r, _, _ in verdicts), failures) from error


def disagreeing_streams(digests: Mapping[int, str]) -> dict[int, str]:
    """`{rank: why}` for every rank whose stream digest is not the group's most common one (ties: the lowest
    rank's). Every rank iterates the stream's gathers in step, so one rank with another tensor list would
    leave the others waiting in a gather, or gather the wrong tensors."""
    if len(set(digests.values())) <= 1:
        return {}
    counts: dict[str, int] = {}
    for d in digests.values():
        counts[d] = counts.get(d, 0) + 1
    first = {d: min(r for r, x in digests.items() if x == d) for d in counts}
    common = max(counts, key=lambda d: (counts[d], -first[d]))
    holders = sorted(r for r, d in digests.items() if d == common)
    return {
        r: (
            f"StreamDisagreementError: this rank's weight stream (digest {d}) differs from ranks {holders}' "
            f"({common}): the ranks would gather different tensors. Fix: build the actor identically on every "
            "rank (same model path, override config, LoRA merge and QAT settings)"
        )
        for r, d in sorted(digests.items())
        if d != common
    }


def drain(stream: Iterable[Any], error: BaseException) -> None:
    """After `error` stopped this rank's push mid-stream: run the export to its end so the peers' collectives
    match. A failure of the export itself is noted on `error` (which the caller raises)."""
    try:
        for _ in stream:
            pass
    except Exception as exc:  # noqa: BLE001 - the first error is the one to report
        logger.warning("p2p: the export failed while draining it after %s: %s", describe(error), describe(exc))
        error.add_note(f"while draining the export afterwards: {describe(exc)}")

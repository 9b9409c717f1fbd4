"""Who exports and who writes: a rank's pipeline stage, the stage's ranks, and its senders.

A stage's export runs TP/EP gathers, which are collectives over ranks of that stage. The plan names only a
few of them as senders (there may be fewer rollout targets than trainer ranks), but every rank of the stage
must still run the export to the end, or the senders' gathers wait forever. `drive_export` does exactly that:
senders get the stream, the others drain it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from verl_p2p.errors import P2PError
from verl_p2p.planning.plan import SourceRank, TransferPlan


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

"""Who exports and who writes: a rank's pipeline stage, the stage's ranks, and its senders.

A stage's export runs TP/EP gathers, which are collectives over ranks of that stage. The plan names only a
few of them as senders (there may be fewer rollout targets than trainer ranks), but every rank of the stage
must still run the export to the end, or the senders' gathers wait forever. `drive_export` does exactly that:
senders get the stream, the others drain it.

The same holds when something goes wrong. A rank that finds a problem before exporting (a plan it cannot
apply, a target whose published weights disagree) must not simply raise: its peers would enter the export
and wait in a gather for it. So every rank of the export group first agrees on go/no-go (`agree_to_export`:
one small all_gather over a gloo group of exactly the ranks whose collectives the export runs); when any rank
says no, every rank raises `ExportAbortedError` naming each failed rank and its cause, and none exports. The
group is p2p's own, with `p2p_push_deadline_s` as its timeout (`BoundedGroups`): a member that died or hangs
costs the others at most that long, never torch's default 30 minutes. A
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

from verl_p2p.config import P2PConfig
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


class GroupBrokenError(P2PError):
    """A collective over one of p2p's own gloo groups failed or timed out (a member died or hangs): the group is
    dropped on this rank, and the next sync makes a new one (`BoundedGroups`)."""


@dataclass
class _Held:
    group: Any
    name: str


class BoundedGroups:
    """p2p's own gloo groups over the trainer ranks (the go/no-go, the outcome exchange), each with a timeout.

    A group is made on first use of its rank set and reused; one on which a collective failed or timed out is
    destroyed and never reused (gloo closes its pairs on a timeout). Every member names a group the same way,
    `verl_p2p/<tag>/<ranks>/<epoch>`, where `epoch` is the caller's count of syncs (every trainer rank gets every
    sync's call, in order): torch's `new_group(use_local_synchronization=True)` hashes the ranks with the number
    of groups this process made so far, which differs between ranks that made a replacement and a rank that
    stalled meanwhile, and would leave them rendezvousing under different names until the timeout, forever. A
    member still holding the old group fails at once on it (its peers destroyed it), drops it, and the next
    sync all members make the same new one. Making a group waits at most `timeout_s` for its members.
    """

    def __init__(self) -> None:
        self._held: dict[tuple[str, tuple[int, ...]], _Held] = {}
        self._lock = threading.Lock()

    def exchange(self, tag: str, ranks: Sequence[int], item: Any, timeout_s: float, epoch: int) -> list[Any]:
        """all_gather_object of `item` over `ranks` (this rank among them); GroupBrokenError when the group
        cannot be made or the gather fails within `timeout_s` (the group is dropped)."""
        import torch.distributed as dist

        key = (tag, tuple(sorted(set(ranks))))
        try:
            group = self._group(key, timeout_s, epoch)
            items: list[Any] = [None] * len(key[1])
            dist.all_gather_object(items, item, group=group)
            return items
        except Exception as exc:
            self.drop(key)
            raise GroupBrokenError(
                f"p2p {tag} over trainer ranks {list(key[1])} did not complete within {timeout_s:g} s "
                f"(p2p_push_deadline_s; a rank died or hangs): {describe(exc).splitlines()[0]}"
            ) from exc

    def _group(self, key: tuple[str, tuple[int, ...]], timeout_s: float, epoch: int) -> Any:
        with self._lock:
            held = self._held.get(key)
            if held is None:
                name = f"verl_p2p/{key[0]}/{'_'.join(map(str, key[1]))}/{epoch}"
                held = self._held[key] = _Held(_new_gloo_group(list(key[1]), name, timeout_s), name)
            return held.group

    def drop(self, key: tuple[str, tuple[int, ...]]) -> None:
        with self._lock:
            held = self._held.pop(key, None)
        if held is not None:
            import torch.distributed as dist

            try:  # closes its pairs: a member still on it fails at once instead of waiting out the timeout
                dist.destroy_process_group(held.group)
            except Exception as exc:  # noqa: BLE001 - dropped either way
                logger.warning("p2p: destroying the broken group %s: %s", held.name, describe(exc))

    def names(self) -> list[str]:
        with self._lock:
            return sorted(h.name for h in self._held.values())


def _new_gloo_group(ranks: list[int], name: str, timeout_s: float) -> Any:
    """A gloo group of `ranks` named `name`, made by its members only, bounded by `timeout_s` (its rendezvous and
    every collective). torch's own helper with an explicit name: `new_group` cannot take one (see BoundedGroups)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    me = dist.get_rank()
    group, _ = c10d._new_process_group_helper(
        len(ranks),
        ranks.index(me),
        ranks,
        "gloo",
        c10d._world.pg_map[default][1],
        group_name=c10d.GroupName(name),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(ranks)}
    return group


GROUPS = BoundedGroups()  # one per trainer process: the groups live as long as the torch world


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def agree_to_export(
    rank: int,
    ranks: Sequence[int] | None,
    error: BaseException | None,
    stream_digest: str | None = None,
    *,
    timeout_s: float = P2PConfig.p2p_push_deadline_s,
    epoch: int = 0,
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
        members = range(dist.get_world_size()) if ranks is None else ranks
        verdicts = GROUPS.exchange("go_no_go", members, mine, timeout_s, epoch)
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

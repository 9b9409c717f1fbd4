"""Driver side of a sync: trainer sources x rollout ranks -> one `Assignment` per trainer rank.

Pure apart from the small driver-process cache the engine-only path needs (verl calls `build_topology` as a
classmethod every sync, with whatever `prepare` returned): rank info travels from each rollout leader once,
and a trainer rank is sent its assignment only when it does not hold the current generation already.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl_p2p.errors import P2PError
from verl_p2p.planning.fsdp import build_full_stream_plan
from verl_p2p.planning.layout import RankLayout, layout_from_server_args
from verl_p2p.planning.plan import SourceRank, build_transfer_plan, split_by_bytes
from verl_p2p.planning.targets import RemoteRankInfo, TargetRank

# server args that change the bytes a rank holds, beside its layout
_BYTE_ARGS = (
    "model_path",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "json_model_override_args",
    "disable_shared_experts_fusion",  # set per rank from what it publishes (planning/shared_experts.py)
    "enforce_shared_experts_fusion",
)


@dataclass(frozen=True)
class SourceMeta:
    """What a trainer rank's `prepare()` reports: where it sits and which plan generation it holds."""

    rank: int
    pp_stage: int
    pp_size: int = 1
    generation: int = 0
    # the rank streams the whole model (verl's FSDP engine): every rank sends a part of every target
    # (`planning.fsdp`); False: a Megatron rank exporting its pipeline stage
    full_stream: bool = False
    # the ranks its export runs collectives with (PP-local Megatron: its TP, EP and expert-TP groups); None: every
    # rank (FSDP's gathers, the full export's): a rank that cannot take part blocks every rank it reaches this way
    export_peers: tuple[int, ...] | None = None


@dataclass(frozen=True)
class EngineMeta:
    """What a rollout leader's `prepare()` reports; `server_info`/`rank_infos` only until acknowledged."""

    engine: int
    digest: str
    server_info: Mapping[str, Any] | None = None
    rank_infos: Mapping[int, RemoteRankInfo] | None = None
    sessions: bool | None = None  # whether the server has weight-update sessions (known once begin was sent)


@dataclass(frozen=True)
class Assignment:
    """One trainer rank's part of plan `generation`: the targets it writes its stage's bytes to."""

    generation: int
    rank: int
    pp_stage: int
    pp_size: int = 1
    stage_ranks: tuple[int, ...] = ()  # the trainer ranks of this stage that export together (its go/no-go group)
    stage_senders: tuple[int, ...] = ()  # those of them with targets
    targets: tuple[TargetRank, ...] = ()
    rank_infos: Mapping[TargetRank, RemoteRankInfo] = field(default_factory=dict, repr=False)
    layouts: Mapping[TargetRank, RankLayout] = field(default_factory=dict, repr=False)
    server_infos: Mapping[int, Mapping[str, Any]] = field(default_factory=dict, repr=False)
    # engines of `targets` known to lack weight-update sessions (SGLang < 0.5.21): no post-load processing
    sessionless_engines: frozenset[int] = frozenset()
    # target -> (part index, part count): this rank writes only that part of the target's parameters (several
    # ranks of the stage share the target: `planning.plan.split_by_bytes`); absent: all of them
    parts: Mapping[TargetRank, tuple[int, int]] = field(default_factory=dict)
    # whether the trainer may open its targets' connections at apply, by a read: False for a plan handed out inside
    # the pause (a re-push's, or one the pause changed), where the read would only delay the writes
    warm_up: bool = True
    # target -> the names of that part: computed once, on the driver, from the target's published parameters, so
    # every sender of the target writes a part of the same split (`check_parts`); absent: all of them
    part_names: Mapping[TargetRank, frozenset[str]] = field(default_factory=dict, repr=False)
    # the driver waits for each rank's own outcome (the manager path): the ranks exchange no outcomes, so a dead
    # or hung peer cannot hold a rank that finished; False: verl's manager, which sees rank 0's answer only
    driver_collects: bool = False
    # False: the rank neither exports nor runs the go/no-go (it, or a rank it exports with, died or is late): its
    # push returns at once; see `assign`'s `unreachable`
    export: bool = True

    @property
    def is_source(self) -> bool:
        return bool(self.targets)


def layout_key(server_info: Mapping[str, Any], layout: RankLayout) -> Hashable:
    """The driver's placement hint: targets with equal keys likely hold equal bytes, so one source writes them.

    Only a hint (the driver has neither SGLang nor the HF config): the trainer caches replicas by the replica's
    own, finer key (`verl_p2p.replica.replica_key`), so a coarse match here costs a second replica, never bytes."""
    return (layout.key, tuple(str(server_info.get(k)) for k in _BYTE_ARGS))


def layouts_of(engine: int, server_info: Mapping[str, Any], ranks: Sequence[int]) -> dict[TargetRank, RankLayout]:
    return {TargetRank(engine, r): layout_from_server_args(server_info, r) for r in ranks}


def assign(
    sources: Sequence[SourceMeta],
    server_infos: Mapping[int, Mapping[str, Any]],
    rank_infos: Mapping[TargetRank, RemoteRankInfo],
    layouts: Mapping[TargetRank, RankLayout],
    generation: int,
    sessionless: Iterable[int] = (),
    exclude: Iterable[int] = (),
    unreachable: Iterable[int] = (),
) -> dict[int, Assignment]:
    """Plan every target onto its sources per PP stage (one, or several each writing a part when the stage has
    more ranks than targets); every trainer rank gets an Assignment (maybe idle).
    `sessionless`: engines whose servers answered that they have no weight-update sessions.
    `exclude`: trainer ranks that must not send (their last push failed naming no target): they get idle
    assignments (the export is collective, they still run it); a stage left without a sender is refused.
    `unreachable`: ranks that died or are late, so cannot take part in any collective. Every rank connected to one
    through export collectives (`SourceMeta.export_peers`) gets an assignment that skips the export and the
    go/no-go; the others of its stage (data-parallel copies) export among themselves and take the targets. A stage
    left with no rank that can export is refused, naming the ranks and every target left paused."""
    sizes = {s.pp_size for s in sources}
    if len(sizes) > 1:
        raise P2PError(f"trainer ranks disagree on the pipeline size: {sorted(sizes)}")
    held = {s.pp_stage for s in sources}
    if sources and held != set(range(max(sizes))):
        raise P2PError(f"trainer ranks hold pipeline stages {sorted(held)}, expected 0..{max(sizes) - 1}")
    missing = sorted(t for t in rank_infos if t not in layouts)
    if missing:
        raise P2PError(f"no layout for rollout target(s) {missing[:4]}")
    targets = sorted(rank_infos)
    keys = {t: layout_key(server_infos[t.engine], layouts[t]) for t in targets}
    unreachable = frozenset(unreachable)
    blocked = blocked_ranks(sources, unreachable)
    cut_off = sorted({s.pp_stage for s in sources} - {s.pp_stage for s in sources if s.rank not in blocked})
    if targets and cut_off:
        raise P2PError(
            f"no trainer rank of pipeline stage(s) {cut_off} can export without trainer rank(s) "
            f"{sorted(unreachable)} (died, or did not answer within p2p_push_deadline_s): the export's collectives "
            f"of ranks {sorted(r for r in blocked if r not in unreachable)} run with them (tensor/expert-parallel "
            "peers, or every rank of an FSDP or full export). Left paused with weights unknown: "
            f"{', '.join(map(str, targets))}. Fix: restart the trainer rank(s), or the job"
        )
    exclude = frozenset(exclude) | blocked
    senders = [s for s in sources if s.rank not in exclude]
    orphaned = sorted({s.pp_stage for s in sources} - {s.pp_stage for s in senders})
    if targets and orphaned:
        raise P2PError(
            f"no trainer rank of pipeline stage(s) {orphaned} can send: every one of them is excluded (failed or "
            f"died: {sorted(exclude)}); restart the trainer ranks, or the job"
        )
    modes = {s.full_stream for s in sources}
    if len(modes) > 1:
        raise P2PError("trainer ranks disagree on their export: some stream the whole model (FSDP), some a stage")
    if True in modes:  # every rank holds every tensor in turn: each sends its part of every target
        plan = build_full_stream_plan([SourceRank(s.rank, 0) for s in senders], targets)
    else:
        plan = build_transfer_plan([SourceRank(s.rank, s.pp_stage) for s in senders], targets, keys)
    names = _part_names(plan, rank_infos)
    stage_ranks: dict[int, list[int]] = {}
    for s in sorted(sources, key=lambda s: s.rank):
        if s.rank not in blocked:
            stage_ranks.setdefault(s.pp_stage, []).append(s.rank)
    sessionless = frozenset(sessionless)
    result = {}
    for source in sources:
        mine = plan.targets_of(source.rank)
        ranks = (source.rank,) if source.rank in blocked else tuple(stage_ranks[source.pp_stage])
        result[source.rank] = Assignment(
            generation=generation,
            rank=source.rank,
            pp_stage=source.pp_stage,
            pp_size=source.pp_size,
            stage_ranks=ranks,
            stage_senders=tuple(r for r in ranks if plan.targets_of(r)),
            targets=mine,
            rank_infos={t: rank_infos[t] for t in mine},
            layouts={t: layouts[t] for t in mine},
            server_infos={e: server_infos[e] for e in sorted({t.engine for t in mine})},
            sessionless_engines=frozenset(t.engine for t in mine) & sessionless,
            parts={t: plan.part_of(source.rank, t) for t in mine if plan.part_of(source.rank, t)[1] > 1},
            part_names={t: names[(source.rank, t)] for t in mine if (source.rank, t) in names},
            export=source.rank not in blocked,
        )
    check_parts(result, rank_infos)
    return result


def blocked_ranks(sources: Sequence[SourceMeta], unreachable: frozenset[int]) -> frozenset[int]:
    """The unreachable ranks and every rank connected to one through export collectives (the connected components
    of the `export_peers` graph that hold an unreachable rank): none of them can finish an export."""
    if not unreachable:
        return frozenset()
    ranks = sorted(s.rank for s in sources)
    parent = {r: r for r in ranks}

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for s in sources:
        for peer in ranks if s.export_peers is None else s.export_peers:
            if peer in parent:
                parent[root(peer)] = root(s.rank)
    cut = {root(r) for r in unreachable if r in parent}
    return frozenset(r for r in ranks if root(r) in cut) | unreachable


def _part_names(plan: Any, rank_infos: Mapping[TargetRank, RemoteRankInfo]) -> dict[tuple[int, TargetRank], frozenset]:
    """(sender, target) -> the published parameter names of its part, for every split target: one
    `split_by_bytes` per target over what the target published, whatever the senders' own plans say."""
    splits: dict[tuple[TargetRank, int], list[frozenset[str]]] = {}
    out = {}
    for (rank, target), (index, count) in plan.parts.items():
        key = (target, count)
        if key not in splits:
            sizes = ((name, p.nbytes) for name, p in rank_infos[target].params.items())
            splits[key] = split_by_bytes(sizes, count)
        out[(rank, target)] = splits[key][index]
    return out


def check_parts(assignments: Mapping[int, Assignment], rank_infos: Mapping[TargetRank, RemoteRankInfo]) -> None:
    """Refuse assignments whose parts of a target, per pipeline stage, are not exactly its published parameters:
    disjoint, and together complete. Runs on the driver before any assignment is sent."""
    shared: dict[tuple[TargetRank, int], list[tuple[int, frozenset[str]]]] = {}
    for a in assignments.values():
        for target, names in a.part_names.items():
            shared.setdefault((target, a.pp_stage), []).append((a.rank, names))
        for target in set(a.parts) - set(a.part_names):
            raise P2PError(f"trainer rank {a.rank} writes part {a.parts[target]} of {target} without its names")
    problems = []
    for (target, stage), parts in sorted(shared.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        published = set(rank_infos[target].params)
        seen: dict[str, int] = {}
        for rank, names in parts:
            twice = sorted(n for n in names if n in seen)
            if twice:
                problems.append(f"{target} stage {stage}: ranks {seen[twice[0]]} and {rank} both write {twice[:3]}")
            seen.update(dict.fromkeys(names, rank))
        missing, stray = sorted(published - set(seen)), sorted(set(seen) - published)
        if missing:
            problems.append(f"{target} stage {stage}: no sender writes {missing[:3]} ({len(missing)} in all)")
        if stray:
            problems.append(f"{target} stage {stage}: parts name unpublished parameters {stray[:3]}")
    if problems:
        raise P2PError(
            "the senders' parts of a rollout rank do not cover its published parameters exactly (a bug in the "
            "split, or assignments changed after planning): " + "; ".join(problems)
        )


@dataclass
class _Engine:
    digest: str
    server_info: Mapping[str, Any]
    rank_infos: Mapping[int, RemoteRankInfo]
    layouts: Mapping[TargetRank, RankLayout]
    sessions: bool | None = None


class TopologyCache:
    """The engine-only path's driver state: published engines, the current generation and its assignments."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[int, _Engine] = {}
        self._key: tuple | None = None
        self.generation = 0
        self.assignments: dict[int, Assignment] = {}

    def update_engine(self, meta: EngineMeta) -> None:
        known = self._engines.get(meta.engine)
        if meta.rank_infos is None or meta.server_info is None:
            if known is None or known.digest != meta.digest:
                raise P2PError(
                    f"rollout engine {meta.engine} did not send its rank info and this driver has no copy of "
                    f"digest {meta.digest}: the driver restarted while the rollout workers kept running; "
                    "restart the rollout replicas (or the job)"
                )
            if meta.sessions is not None:
                known.sessions = meta.sessions
            return
        if known is not None and known.digest == meta.digest:
            if meta.sessions is not None:
                known.sessions = meta.sessions
            return
        ranks = sorted(meta.rank_infos)
        tp = int(meta.server_info.get("tp_size") or 1)
        if ranks != list(range(tp)):
            raise P2PError(f"rollout engine {meta.engine} published ranks {ranks}, expected 0..{tp - 1} (tp_size={tp})")
        try:
            layouts = layouts_of(meta.engine, meta.server_info, ranks)
        except P2PError as exc:
            raise type(exc)(f"rollout engine {meta.engine}: {exc}") from exc
        self._engines[meta.engine] = _Engine(
            meta.digest, dict(meta.server_info), dict(meta.rank_infos), layouts, meta.sessions
        )

    def plan(self, sources: Sequence[SourceMeta], engines: Sequence[int]) -> tuple[int, dict[int, Assignment]]:
        """The (generation, assignments) for these sources and engines; a new generation only on change."""
        with self._lock:
            for gone in set(self._engines) - set(engines):
                del self._engines[gone]
            sessionless = sorted(e for e in engines if self._engines[e].sessions is False)
            key = (
                tuple(sorted((s.rank, s.pp_stage, s.pp_size) for s in sources)),
                tuple(sorted((e, self._engines[e].digest) for e in engines)),
                tuple(sessionless),
            )
            if key != self._key:
                server_infos = {e: self._engines[e].server_info for e in engines}
                rank_infos = {TargetRank(e, r): i for e in engines for r, i in self._engines[e].rank_infos.items()}
                layouts = {t: lay for e in engines for t, lay in self._engines[e].layouts.items()}
                generation = self.generation + 1
                self.assignments = assign(sources, server_infos, rank_infos, layouts, generation, sessionless)
                self.generation, self._key = generation, key
            return self.generation, self.assignments

    def reset(self) -> None:
        """Forget every engine; generations keep counting up so no rank mistakes a new plan for its old one."""
        with self._lock:
            self._engines.clear()
            self._key, self.assignments = None, {}


# One per driver process, on purpose: verl's stock manager calls `build_topology` as a classmethod every sync,
# with no instance to own a cache; `reset()` clears it (a new trainer, or a test)
DRIVER_CACHE = TopologyCache()


def sole_source_assignment(connection: Any, sessionless: Iterable[int] = ()) -> Assignment:
    """The whole plan of a trainer that is one source (rank 0, one pipeline stage): every target of `connection`
    (a lifecycle Connection) is its own. What the demo and the e2e harness push with. `sessionless`: as for
    `assign` (the lifecycle's `sessionless_engines()`), so a post-load model is refused there too."""
    return assign(
        [SourceMeta(0, 0, 1)],
        connection.server_infos,
        connection.rank_infos,
        connection.layouts,
        connection.generation,
        sessionless,
    )[0]

"""The trainer source's data plane: HF stream -> stager -> replica.load into a transfer slot -> writer sends the
slot to every target holding those bytes, while the next slot fills (docs/architecture.md, "The path of one byte").

The replica is an executor (`verl_p2p.replica.compiled.make_executor`): the compiled copy programs or
SGLang's loader; on CUDA its copies are asynchronous, so the slot's device is synchronized before its bytes
are submitted. Targets whose replicas have equal keys hold byte-identical shards, so those bytes are loaded
once and written to each. A parameter is loaded only once all its HF inputs arrived (never half-updated); one
larger than a slot is loaded and written chunk by chunk. At the end every parameter of every target was
written exactly once, or the push raises naming what is missing or which targets failed.

What can be checked before the first write is (`check_push`): published names, sizes and ranges, and an
FP8 export into a plan without FP8 inputs. What shows only while streaming is checked for each HF tensor
before anything is loaded from it (`stream_checks.refusal`).

A little over 500 lines on purpose: the pre-write checks read the push's own target groups (`_Group`), and
splitting them out would make the two modules import each other.
"""

from __future__ import annotations

import fnmatch
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from verl_p2p.errors import RemoteMismatchError, TransferError, UnsupportedLayoutError
from verl_p2p.planning.targets import RemoteRankInfo, TargetRank
from verl_p2p.trainer.coverage import check_coverage
from verl_p2p.trainer.fp8_stream import plan_fp8_targets, quantized_stream
from verl_p2p.trainer.stream_checks import StreamRefusedError, check_fp8_export, refusal
from verl_p2p.transfer.buffers import ALIGN, Slot, TransferBuffers
from verl_p2p.transfer.writer import TargetFailure, WriteEntry, Writer, push_error


class IncompletePushError(TransferError):
    """The HF stream ended before every parameter of every target could be written.

    `unknown_targets` (see TransferError): every target of a group with a parameter not written, plus every
    target whose writes failed; the others received all their bytes."""


class ParamPlanLike(Protocol):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    feeds: Sequence[str]


class StagerLike(Protocol):
    def offer(self, hf_name: str, tensor: torch.Tensor) -> list[str]: ...
    def take(self, param_name: str) -> dict[str, torch.Tensor]: ...
    def release(self, param_name: str) -> None: ...
    def pending(self) -> Mapping[str, set[str]]: ...
    def held_bytes(self) -> int: ...


class ReplicaLike(Protocol):
    """What push needs from `verl_p2p.replica.RankReplica` or `verl_p2p.replica.CompiledReplica`."""

    key: Hashable
    plan: Any  # .params: Mapping[str, ParamPlanLike]

    def stager(self) -> StagerLike: ...
    def load(self, param_name: str, hf_tensors: Mapping[str, torch.Tensor], dst: torch.Tensor) -> None: ...
    def chunks(self, param_name: str, max_bytes: int) -> list[tuple[int, int]]: ...
    def load_chunk(
        self, param_name: str, hf_tensors: Mapping[str, torch.Tensor], offset: int, dst: torch.Tensor
    ) -> None: ...


@dataclass(frozen=True)
class PushTarget:
    """One rollout rank this source writes to, the replica producing its bytes, and what it published.
    `part` (index, count): this source writes only that part of the rank's parameters (`split_by_bytes`);
    the other parts come from other sources holding the same bytes. `names`: that part's parameters."""

    target: TargetRank
    replica: ReplicaLike
    remote: RemoteRankInfo
    part: tuple[int, int] = (0, 1)
    # the part's parameter names, as the driver split the target's published parameters (`topology.check_parts`
    # proved the senders' parts disjoint and complete); None: the whole target (a part needs its names)
    names: frozenset[str] | None = None


@dataclass
class PushMetrics:
    """What one push moved and where its time went (seconds are wall time on the pushing thread)."""

    bytes_per_target: dict[TargetRank, int] = field(default_factory=dict)
    loaded_bytes: int = 0  # bytes produced by replica loads (once per distinct replica key)
    seconds_total: float = 0.0
    seconds_hf_wait: float = 0.0  # blocked on the HF stream (trainer export)
    seconds_stage: float = 0.0  # stager bookkeeping
    seconds_load: float = 0.0  # replica loads into transfer slots
    seconds_write_wait: float = 0.0  # blocked until a slot's writes returned
    num_batches: int = 0
    peak_staged_bytes: int = 0  # offered HF tensors still alive, at their peak
    slot_bytes: int = 0  # bytes of the transfer slots

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_target.values())

    @property
    def gbps(self) -> float:
        return self.total_bytes / self.seconds_total / 1e9 if self.seconds_total > 0 else 0.0

    def to_dict(self, prefix: str = "checkpoint_engine/p2p/") -> dict[str, float]:
        """Flat numbers for verl's metrics."""
        return {
            f"{prefix}bytes": float(self.total_bytes),
            f"{prefix}loaded_bytes": float(self.loaded_bytes),
            f"{prefix}gbps": self.gbps,
            f"{prefix}seconds/total": self.seconds_total,
            f"{prefix}seconds/hf_wait": self.seconds_hf_wait,
            f"{prefix}seconds/stage": self.seconds_stage,
            f"{prefix}seconds/load": self.seconds_load,
            f"{prefix}seconds/write_wait": self.seconds_write_wait,
            f"{prefix}num_targets": float(len(self.bytes_per_target)),
            f"{prefix}peak_staged_bytes": float(self.peak_staged_bytes),
        }


@dataclass(frozen=True)
class StageShare:
    """The part of every rollout rank one PP stage writes: the parameters fed only by HF tensors this stage
    exports (`owns`); parameters no HF tensor feeds (pure padding fills) are written by `writes_feedless`
    (stage 0). With PP > 1 each target gets one sender per stage, and together the stages write every byte."""

    owns: Callable[[str], bool]
    writes_feedless: bool

    def select(self, params: Mapping[str, ParamPlanLike]) -> dict[str, ParamPlanLike]:
        mine = {}
        for name, p in params.items():
            owned = [self.owns(f) for f in p.feeds]
            if all(owned) if owned else self.writes_feedless:
                mine[name] = p
            elif any(owned):
                split = sorted(f for f in p.feeds if not self.owns(f))
                raise UnsupportedLayoutError(
                    f"rollout parameter {name} is fed by HF tensors of several pipeline stages ({split[:4]} are "
                    "exported by another stage): no single stage can write it whole; use a trainer layout that keeps "
                    "these tensors in one stage"
                )
        return mine


class _Group:
    """Targets sharing one replica key: their bytes are loaded once and written to each."""

    def __init__(self, replica: ReplicaLike, targets: list[PushTarget], share: StageShare | None = None) -> None:
        self.replica = replica
        self.targets = targets
        params: Mapping[str, ParamPlanLike] = replica.plan.params
        self.params = share.select(params) if share is not None else params
        index, count = targets[0].part
        self.names = targets[0].names
        if self.names is not None:  # the driver's part of the target: the stage's parameters it names
            self.params = {n: p for n, p in self.params.items() if n in self.names}
        elif count > 1:
            raise ValueError(
                f"part {index + 1} of {count} of {targets[0].target} comes without its parameter names: the driver "
                "splits a target (backend.topology.assign), never a sender on its own"
            )
        self.stager = replica.stager()
        self.done: set[str] = set()

    def describe(self) -> str:
        index, count = self.targets[0].part
        part = f" (part {index + 1} of {count})" if count > 1 else ""
        return ", ".join(f"engine {t.target.engine} rank {t.target.rank}" for t in self.targets) + part

    def without_feeds(self) -> list[str]:
        """Params no HF tensor feeds (only constant fills): ready from the start."""
        return [name for name, p in self.params.items() if not p.feeds]

    def take(self, param: str) -> dict[str, torch.Tensor]:
        """The param's HF inputs; the stager drops those no other pending param needs."""
        if param in self.done:
            raise IncompletePushError(
                f"param {param!r} for {self.describe()} became ready twice (an HF tensor was streamed twice?)"
            )
        self.done.add(param)
        return self.stager.take(param) if self.params[param].feeds else {}


class _Pusher:
    """Loads ready params into the current slot and submits them in pieces of about `flush_bytes`, so writes
    start early and overlap the loads; a full slot is left for the other one, reused once its writes returned."""

    def __init__(
        self, buffers: TransferBuffers, writer: Writer, metrics: PushMetrics, flush_bytes: int, load_threads: int | None
    ) -> None:
        self.buffers = buffers
        self.load_threads = load_threads
        self.flush_bytes = flush_bytes
        self.unsent = 0
        self.writer = writer
        self.metrics = metrics
        self.failures: dict[TargetRank, TargetFailure] = {}
        self.slot: Slot | None = None
        self.fill = 0
        self.entries: list[WriteEntry] = []
        self.live_bytes = 0
        self.cuda_devices: set[torch.device] = set()  # devices with loads the writes must wait for

    # staging-memory accounting: bytes of offered HF tensors that are still alive (held by anyone)
    def track(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.live_bytes += nbytes
        self.metrics.peak_staged_bytes = max(self.metrics.peak_staged_bytes, self.live_bytes)
        weakref.finalize(tensor, self._dead, nbytes)

    def _dead(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def add(self, group: _Group, param: str) -> None:
        """Load one ready param (chunk by chunk when larger than a slot) and queue its writes."""
        threads = torch.get_num_threads()
        if self.load_threads is not None and self.load_threads < threads:
            torch.set_num_threads(self.load_threads)  # only around the loads, not the caller's export
        try:
            self._add(group, param)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def _add(self, group: _Group, param: str) -> None:
        plan = group.params[param]
        nbytes = int(plan.nbytes)
        feeds = group.take(param)
        devices = {t.device for t in feeds.values() if t.device.type == "cuda"}
        if nbytes > self.buffers.slot_bytes or not plan.feeds:
            for offset, length in group.replica.chunks(param, self.buffers.slot_bytes):
                dst = self._space(length)
                self.cuda_devices.update(devices)  # after _space: its flush fenced the loads before, not this one
                t0 = time.perf_counter()
                group.replica.load_chunk(param, feeds, offset, dst)
                self.metrics.seconds_load += time.perf_counter() - t0
                self._entries(group, param, offset, dst, length)
        elif nbytes > 0:
            dst = self._space(nbytes)
            self.cuda_devices.update(devices)
            t0 = time.perf_counter()
            group.replica.load(param, feeds, dst)
            self.metrics.seconds_load += time.perf_counter() - t0
            self._entries(group, param, 0, dst, nbytes)

    def _entries(self, group: _Group, param: str, offset: int, dst: torch.Tensor, nbytes: int) -> None:
        self.metrics.loaded_bytes += nbytes
        self.unsent += nbytes
        for t in group.targets:
            if t.target not in self.failures:
                self.entries.append(WriteEntry(t.target, param, offset, dst.data_ptr(), nbytes))
        if self.unsent >= self.flush_bytes:
            self.flush()  # start writing what is loaded; the rest of the slot keeps filling meanwhile

    def _fence(self) -> None:
        """CUDA copies into a slot are asynchronous: wait for them before the transport reads the slot. A load
        registers its feeds' devices after `_space` (whose own flush fences and clears the set): registered
        before, a load that starts a new slot was submitted unfenced, and its first bytes went out unwritten
        (zeros of fresh pinned memory; seen on the H200 with GPU feeds into pinned slots)."""
        if self.slot is not None and self.slot.tensor.device.type == "cuda":
            self.cuda_devices.add(self.slot.tensor.device)
        for device in self.cuda_devices:
            torch.cuda.synchronize(device)
        self.cuda_devices.clear()

    def _space(self, nbytes: int) -> torch.Tensor:
        """A uint8 view of `nbytes` free bytes in the current slot, submitting it first when full."""
        start = -(-self.fill // ALIGN) * ALIGN
        if self.slot is None or start + nbytes > self.slot.nbytes:
            self.flush()
            self.slot = None
            t0 = time.perf_counter()
            self.slot, failures = self.buffers.next_slot()
            self.metrics.seconds_write_wait += time.perf_counter() - t0
            self._record(failures)
            start = 0
        self.fill = start + nbytes
        return self.slot.view(start, nbytes)

    def flush(self) -> None:
        """Submit the loaded, unsent part of the current slot."""
        if self.slot is not None and self.entries:
            t0 = time.perf_counter()
            self._fence()
            self.metrics.seconds_load += time.perf_counter() - t0
            batch = self.writer.submit(self.entries)
            self.slot.track(batch)
            self.metrics.num_batches += 1
            for target, n in batch.bytes_per_target.items():
                self.metrics.bytes_per_target[target] = self.metrics.bytes_per_target.get(target, 0) + n
        self.entries, self.unsent = [], 0

    def finish(self, flush: bool = True) -> None:
        """Submit what is loaded (unless `flush` is False: a refused push), then wait for every write."""
        if flush:
            self.flush()
        self.entries, self.unsent = [], 0
        t0 = time.perf_counter()
        self._record(self.buffers.drain())
        self.metrics.seconds_write_wait += time.perf_counter() - t0

    def _record(self, failures: Iterable[TargetFailure]) -> None:
        for f in failures:
            self.failures.setdefault(f.target, f)


def expected_params(groups: Sequence[_Group]) -> dict[TargetRank, dict[str, tuple[int, int]]]:
    """`{target: {param: (numel, element_size)}}` this source will write (what `Writer.validate` checks)."""
    out: dict[TargetRank, dict[str, tuple[int, int]]] = {}
    for g in groups:
        shard = {name: (int(p.nbytes) // p.dtype.itemsize, p.dtype.itemsize) for name, p in g.params.items()}
        for t in g.targets:
            out[t.target] = shard
    return out


def group_targets(targets: Sequence[PushTarget], share: StageShare | None = None) -> list[_Group]:
    """One group per distinct replica key and part (first replica of a key is used for all its targets)."""
    by_key: dict[Hashable, list[PushTarget]] = {}
    for t in targets:
        by_key.setdefault((t.replica.key, t.part, t.names), []).append(t)
    seen = set()
    for t in targets:
        if t.target in seen:
            raise ValueError(f"{t.target} appears twice in the push targets")
        seen.add(t.target)
    return [_Group(ts[0].replica, ts, share) for ts in by_key.values()]


def check_push(
    targets: Sequence[PushTarget],
    writer: Writer,
    share: StageShare | None = None,
    *,
    streams_fp8: bool = False,
    unwritten_allowed: Sequence[str] = (),
) -> list[_Group]:
    """Everything checkable before the first write; raises (nothing written) or returns the push's groups.

    RemoteMismatchError when a target's published weights differ from what would be written (names, sizes,
    overlapping ranges: `Writer.validate`; published parameters the plan never writes, unless listed in
    `unwritten_allowed`: `coverage.check_coverage`); StreamRefusedError when the export streams FP8 weights
    (`streams_fp8`) while no target's plan takes an FP8 input (they would be written without their scales)."""
    for t in targets:
        known = writer.targets.get(t.target)
        if known is None or known.session_id != t.remote.session_id:
            raise ValueError(
                f"{t.target}: the writer was built for other targets/sessions; build it from these targets"
            )
    groups = group_targets(targets, share)
    for g in groups:
        check_part_names(g, unwritten_allowed)
    writer.validate(expected_params(groups))
    check_coverage(  # against the whole rank's plan: with PP > 1 the stages' shares together write it
        {g.describe(): (g.targets[0].remote.params, [*g.replica.plan.params, *g.replica.plan.local]) for g in groups},
        unwritten_allowed,
    )
    if streams_fp8:
        for g in groups:
            check_fp8_export(_planned_specs([g]), [n for p in g.params.values() for n in p.feeds], g.describe())
    return groups


def check_part_names(group: _Group, unwritten_allowed: Sequence[str] = ()) -> None:
    """Refuse a driver-given part naming parameters this rank's plan does not know (neither written nor local):
    the driver split what the target published, so the senders' plans diverge (another SGLang, another cached
    plan) and a parameter would be written by nobody while every sender reports success."""
    if group.names is None:
        return
    plan = group.replica.plan
    known = set(plan.params) | set(getattr(plan, "local", ()) or ())
    stray = sorted(
        n for n in group.names if n not in known and not any(fnmatch.fnmatchcase(n, p) for p in unwritten_allowed)
    )
    if stray:
        raise RemoteMismatchError(
            f"{group.describe()}: the driver's part names {len(stray)} parameter(s) this trainer rank's write plan "
            f"lacks ({stray[:5]}): the senders' plans of this rollout rank diverge; check every trainer node runs "
            "the same SGLang release and clear plan_cache_dir"
        )


def _planned_specs(groups: Sequence[_Group]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """HF name -> (shape, dtype) the groups' write plans were built from (the checkpoint's tensors)."""
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for g in groups:
        specs.update(getattr(g.replica.plan, "hf_specs", None) or {})
    return specs


def push(
    hf_stream: Iterable[tuple[str, torch.Tensor]],
    targets: Sequence[PushTarget],
    buffers: TransferBuffers,
    writer: Writer,
    flush_bytes: int | None = None,
    load_threads: int | None = 1,
    share: StageShare | None = None,
    checked: Sequence[_Group] | None = None,
    allowed_unused: Sequence[str] = (),
    unwritten_allowed: Sequence[str] = (),
) -> PushMetrics:
    """Write this source's bytes to every target; raises RemoteMismatchError before any write when a target's
    published weights differ, StreamRefusedError before loading a streamed tensor the rollout cannot take,
    IncompletePushError when the stream lacked inputs, TransferError when a
    target's write failed or timed out (writes to the other targets still complete). Loaded bytes are
    submitted in pieces of `flush_bytes` (default: an eighth of a slot). `load_threads` caps torch's
    intra-op threads during the replica's loads on CPU: its copies are memory-bound, and OpenMP's barriers
    stall badly when the transport's threads hold the cores (measured: 0.1 vs 7 GB/s on a busy 2-core host);
    None leaves torch's setting alone. GPU copies are unaffected. `share` restricts the push to this PP stage's
    part of every target (None: the source holds the whole model). `checked`: the groups `check_push` returned
    (it runs here when None). `allowed_unused`: fnmatch patterns of HF names no rollout parameter takes that
    may be streamed (dropped). `unwritten_allowed`: fnmatch patterns of published rollout params no sync writes
    that may stay as loaded (used when `checked` is None)."""
    t_start = time.perf_counter()
    groups = (
        list(checked)
        if checked is not None
        else check_push(targets, writer, share, unwritten_allowed=unwritten_allowed)
    )
    planned = _planned_specs(groups)
    metrics = PushMetrics(bytes_per_target={t.target: 0 for t in targets})
    writer.reset_failures()  # waits for an earlier push's call blocked on a stalled rank (at most its timeout)
    buffers.begin()
    metrics.slot_bytes = buffers.slot_bytes_total
    pusher = _Pusher(buffers, writer, metrics, flush_bytes or max(ALIGN, buffers.slot_bytes // 8), load_threads)
    # a sender of a part takes only its part's inputs: the others' tensors are dropped unread and unquantized
    needed = _part_feeds(groups)
    if planned:  # FP8 rollouts: quantize (the targets are the plans', kept across syncs)
        targets = plan_fp8_targets(g.replica.plan for g in groups)
        if needed is not None:
            targets = {name: scale for name, scale in targets.items() if name in needed}
        stream = iter(quantized_stream(hf_stream, planned, targets=targets))
    else:
        stream = iter(hf_stream)
    refused: str | None = None
    try:
        for group in groups:
            for param in group.without_feeds():
                pusher.add(group, param)
        while True:
            t0 = time.perf_counter()
            item = next(stream, None)
            t1 = time.perf_counter()
            metrics.seconds_hf_wait += t1 - t0
            if item is None:
                break
            hf_name, tensor = item
            if needed is not None and hf_name not in needed and (hf_name in planned or not planned):  # others' part
                continue
            if planned:
                refused = refusal(planned, hf_name, tensor, allowed_unused)
                if refused is not None:
                    break
                if hf_name not in planned:  # allowed and taken by nobody: dropped
                    continue
            pusher.track(tensor)
            ready = []
            for g in groups:
                for p in g.stager.offer(hf_name, tensor):
                    if p in g.params:
                        ready.append((g, p))
                    else:  # another source's part: drop the inputs only it needed
                        g.stager.release(p)
            metrics.seconds_stage += time.perf_counter() - t1
            del item, tensor
            for group, param in ready:
                pusher.add(group, param)
    finally:
        pusher.finish(flush=refused is None)
        metrics.seconds_total = time.perf_counter() - t_start
    if refused is not None:
        unknown = [t for t in sorted(metrics.bytes_per_target) if metrics.bytes_per_target[t] > 0]
        if unknown:
            shown = ", ".join(map(str, unknown[:16])) + (" ..." if len(unknown) > 16 else "")
            where = (
                f"; it was refused before anything was loaded from it, but earlier tensors were already written, "
                f"so the bytes of these targets are now unknown (the next sync must rewrite them): {shown}"
            )
        else:
            where = "; it was refused before anything was loaded from it and nothing was written"
        raise StreamRefusedError(refused + where)
    failed = [pusher.failures[t] for t in sorted(pusher.failures)]
    _check_complete(groups, failed)
    if failed:
        raise push_error(failed)
    return metrics


def _part_feeds(groups: Sequence[_Group]) -> set[str] | None:
    """The HF names this source's parameters are fed by, when every group writes a part of its targets (several
    senders share them); None otherwise (a whole-target sender takes the stage's every tensor)."""
    if not groups or any(g.names is None and g.targets[0].part[1] == 1 for g in groups):
        return None
    return {f for g in groups for p in g.params.values() for f in p.feeds}


def _check_complete(groups: Sequence[_Group], failed: Sequence[TargetFailure] = ()) -> None:
    """Raise IncompletePushError when a group has a parameter not written, whatever else failed: its targets'
    completeness is not proven, so they count as unknown together with the `failed` ones (a transport failure
    must never hide an incomplete export: the other targets would be resumed half-written)."""
    problems, incomplete = [], set()
    for g in groups:
        missing = sorted(set(g.params) - g.done)
        if missing:
            incomplete.update(t.target for t in g.targets)
            pending = g.stager.pending()
            lacking = sorted({n for p in missing for n in pending.get(p, ())})
            problems.append(
                f"{g.describe()}: {len(missing)} param(s) not written ({missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}); the HF stream lacked {lacking[:8]}"
                f"{' ...' if len(lacking) > 8 else ''}"
            )
    if not problems:
        return
    also = ""
    if failed:
        also = "\nWrites also failed (their weights are unknown too):\n  " + "\n  ".join(f.describe() for f in failed)
    raise IncompletePushError(
        "the HF stream ended before every parameter could be written; those rollout ranks now hold a mix of "
        "old and new weights:\n  " + "\n  ".join(problems) + also + "\nCheck the trainer export yields every "
        "tensor of this PP stage (export_mode, PP-local export) with the names the rollout's checkpoint uses.",
        unknown_targets=incomplete | {f.target for f in failed},
    )

"""Per-target write lanes with our own deadline, and size/name validation before any byte moves.

Each rollout target (engine, rank) gets one lane: a thread that issues that target's batch writes in
order, so a dead or frozen target never delays the others. At most `num_workers` transport calls run at
once. Mooncake's sync write blocks on a frozen peer until its own timeout; we do not wait for it: a
target's write that passes `timeout_s` fails the target at once, its lane may stay blocked (the buffer
slot it reads from stays quarantined until the call returns), later writes to it are dropped, and
writes to every other target carry on. The deadline is watched over every call in flight, whichever batch
is waited on, and a call past it gives back its worker: blocked calls to frozen targets never keep a healthy
target's queued write from starting (with more frozen targets than workers it would otherwise wait for
Mooncake's own timeout).

A blocked call may still land, so a target stays failed while any call to its session is in flight, also for
the Writer of a later plan generation (`InFlightCalls`, shared by every Writer of one trainer rank): a newer
write landing first would be overwritten by the older bytes when the blocked call lands. A new push first waits
up to one write timeout for such calls to return (`reset_failures`): a rollout rank that stalled past one timeout
and came back is written again instead of refused.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from verl_p2p.errors import RemoteMismatchError, TransferError, WriteInFlightError
from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo, TargetRank, overlapping
from verl_p2p.transfer.base import Transport

logger = logging.getLogger(__name__)

_MISMATCH_FIX = (
    "the rollout and the trainer disagree on the model (architecture/config), the dtype or the parallel layout: "
    "check both load the same checkpoint with the same dtype and that the rollout's server args "
    "(tp/ep/dp-attention) are the ones p2p connected with (reconnect after a rollout restart); names the "
    "rollout does not publish at all can also mean it serves the model through SGLang's generic Transformers "
    "backend because its own model module failed to import (its log: 'Ignore import error when loading "
    "sglang.srt.models.<module>', e.g. No module named 'deep_gemm': install the kernel package SGLang pins)"
)


class InFlightCalls:
    """Transport calls started and not yet returned, per remote session, across Writers. A Writer lives for one plan
    generation, but a call blocked in the transport outlives it and may land late: a later Writer must not write
    that session until the call returned. Each Writer counts under its own token."""

    def __init__(self) -> None:
        self._lock = threading.Condition()  # notified whenever a call returns
        self._calls: dict[str, dict[int, int]] = {}  # session id -> writer token -> calls in flight
        self._tokens = itertools.count(1)

    def token(self) -> int:
        return next(self._tokens)

    def start(self, session_id: str, token: int) -> None:
        with self._lock:
            owners = self._calls.setdefault(session_id, {})
            owners[token] = owners.get(token, 0) + 1

    def finish(self, session_id: str, token: int) -> None:
        with self._lock:
            owners = self._calls.get(session_id, {})
            owners[token] = owners.get(token, 1) - 1
            if owners[token] <= 0:
                del owners[token]
            if not owners:
                self._calls.pop(session_id, None)
            self._lock.notify_all()

    def busy(self, session_id: str, other_than: int | None = None) -> bool:
        """A call to `session_id` is in flight (from a Writer other than token `other_than`, when given)."""
        with self._lock:
            return any(token != other_than for token in self._calls.get(session_id, {}))

    def wait_settled(self, session_ids: Iterable[str], timeout_s: float) -> set[str]:
        """Wait up to `timeout_s` for every call to `session_ids` (from any Writer) to return; those still busy."""
        wanted = set(session_ids)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while busy := wanted & self._calls.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    return busy
                self._lock.wait(left)
        return set()


_STILL_IN_FLIGHT = (
    "a write call to it from an earlier push is still in flight (blocked in the transport) and may still land: "
    "not written now, so that call cannot overwrite newer bytes; it is written again once that call returned"
)


@dataclass(frozen=True)
class WriteEntry:
    """`nbytes` local bytes at `local_addr` go to byte `offset` of `param` on `target`."""

    target: TargetRank
    param: str
    offset: int
    local_addr: int
    nbytes: int


@dataclass(frozen=True)
class TargetFailure:
    """Why a target's bytes are unknown after a push."""

    target: TargetRank
    session_id: str
    reason: str

    def describe(self) -> str:
        return f"engine {self.target.engine} rank {self.target.rank} (session {self.session_id}): {self.reason}"


@dataclass(eq=False)
class _Job:
    """One target's share of one batch: a single transport call."""

    target: TargetRank
    session_id: str
    local: list[int]
    remote: list[int]
    lengths: list[int]
    batch: WriteBatch
    started: float | None = None
    holds_worker: bool = False  # counts against num_workers (until it returns or passes its deadline)
    done: bool = False
    cancelled: bool = False
    error: str | None = None


@dataclass(eq=False)
class WriteBatch:
    """One submit: a transport call per target, all reading one piece of a buffer slot. `wait()` enforces the
    deadline; `settled` is set once every call really returned (a timed-out call may return much later)."""

    writer: Writer
    jobs: list[_Job] = field(default_factory=list)
    settled: threading.Event = field(default_factory=threading.Event)
    bytes_per_target: dict[TargetRank, int] = field(default_factory=dict)

    def wait(self) -> list[TargetFailure]:
        """Block until every target's write returned or timed out; the failures (empty when all landed)."""
        return self.writer._wait(self)

    def _job_finished(self) -> None:
        if all(j.done for j in self.jobs):
            self.settled.set()


class _Lane:
    """The thread that writes to one target, in submission order."""

    def __init__(self, writer: Writer, target: TargetRank) -> None:
        self.writer = writer
        self.target = target
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"p2p-write-e{target.engine}r{target.rank}", daemon=True)
        self.thread.start()

    def _skip(self, job: _Job) -> bool:
        """True when the job must not run (caller holds the writer's lock): its target already failed."""
        w = self.writer
        if job.target in w.failed and not job.done:
            job.cancelled = job.done = True  # the target failed: its later writes are dropped
            job.batch._job_finished()
            w._cond.notify_all()
        return job.cancelled

    def _run(self) -> None:
        w = self.writer
        while (job := self.jobs.get()) is not None:
            with w._cond:
                if self._skip(job):
                    continue
            w._workers.acquire()
            with w._cond:
                if self._skip(job):
                    w._workers.release()
                    continue
                job.started = time.monotonic()
                job.holds_worker = True
                w._inflight.add(job)
                w.inflight.start(job.session_id, w.token)
                w._cond.notify_all()
            try:
                w.transport.write(job.session_id, job.local, job.remote, job.lengths)
            except TransferError as exc:
                job.error = str(exc)
            except Exception as exc:  # noqa: BLE001 - any transport fault fails this target only
                job.error = f"{type(exc).__name__}: {exc}"
            w.inflight.finish(job.session_id, w.token)
            with w._cond:
                w._give_back_worker(job)
                w._inflight.discard(job)
                job.done = True
                if job.error is not None:
                    w._fail(job, job.error)
                job.batch._job_finished()
                w._cond.notify_all()


class Writer:
    """Writes byte ranges into rollout targets' published parameters; see the module docstring."""

    def __init__(
        self,
        transport: Transport,
        targets: Mapping[TargetRank, RemoteRankInfo],
        timeout_s: float,
        num_workers: int = 8,
        inflight: InFlightCalls | None = None,
    ) -> None:
        """`inflight`: the calls in flight of every Writer of this trainer rank (see InFlightCalls); a private one
        when None (a Writer that is never replaced)."""
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 and num_workers={num_workers} >= 1")
        self.transport = transport
        self.targets = dict(targets)
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self._workers = threading.BoundedSemaphore(num_workers)
        self._cond = threading.Condition()
        self._lanes: dict[TargetRank, _Lane] = {}
        self._inflight: set[_Job] = set()  # calls started and not returned, of every batch
        self.inflight = inflight if inflight is not None else InFlightCalls()
        self.token = self.inflight.token()
        self.failed: dict[TargetRank, TargetFailure] = {}

    # ------------------------------------------------------------------ validation
    def validate(self, expected: Mapping[TargetRank, Mapping[str, tuple[int, int]]]) -> None:
        """Raise RemoteMismatchError unless every param the trainer will write is published by its target with
        the same numel and element size, and every published range is a real one that overlaps no other (within
        a rank, or across ranks that publish the same session). Call before any write: nothing is written when
        it raises."""
        problems: list[str] = self._range_problems(sorted(expected))
        for target in sorted(expected):
            info = self.targets.get(target)
            if info is None:
                problems.append(f"{target}: no published transfer-engine info (connect to it first)")
                continue
            where = f"engine {target.engine} rank {target.rank} (session {info.session_id})"
            for name, (numel, element_size) in expected[target].items():
                remote = info.params.get(name)
                if remote is None:
                    problems.append(f"{where}: param {name!r} is not published by the rollout")
                elif (remote.numel, remote.element_size) != (int(numel), int(element_size)):
                    problems.append(
                        f"{where}: param {name!r}: trainer writes numel {numel} x {element_size} B, "
                        f"rollout publishes numel {remote.numel} x {remote.element_size} B"
                    )
            # published params this source does not write: with PP > 1 another stage writes them; those no sync
            # writes at all are refused against the whole plan (trainer.coverage, from check_push)
        if problems:
            shown = "\n  ".join(problems[:20]) + (
                f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            )
            raise RemoteMismatchError(
                f"{len(problems)} mismatch(es) between trainer and rollout weights; nothing was written:\n  {shown}\n"
                f"Likely fix: {_MISMATCH_FIX}"
            )

    def _range_problems(self, targets: list[TargetRank]) -> list[str]:
        """Published ranges that cannot be real: impossible entries, and overlaps inside one session's memory
        (one rank's params, or ranks publishing the same session: a write to one would land in another)."""
        problems: list[str] = []
        by_session: dict[str, list[tuple[str, RemoteParam]]] = {}
        for target in targets:
            info = self.targets.get(target)
            if info is None:
                continue
            where = f"engine {target.engine} rank {target.rank} (session {info.session_id})"
            for name, param in info.params.items():
                problem = param.problem()
                if problem is not None:
                    problems.append(f"{where}: param {name!r}: {problem}")
                else:
                    by_session.setdefault(info.session_id, []).append((f"{target}: {name}", param))
        for session_id, params in by_session.items():
            overlaps = overlapping(params)
            if overlaps:
                more = f" (and {len(overlaps) - 1} more)" if len(overlaps) > 1 else ""
                problems.append(f"session {session_id}: published ranges overlap: {overlaps[0]}{more}")
        return problems

    # ------------------------------------------------------------------ writes
    def reset_failures(self) -> None:
        """Start of a new push: wait up to one write timeout for the write calls of an earlier push (this Writer's
        or an earlier one's) still blocked in the transport towards this Writer's targets, then forget the failed
        targets no call is in flight to any more; one with a call still blocked stays failed (refused: it may
        still land). The wait lets a re-push ride out a rollout rank that stalled past one write timeout and
        came back (its blocked call returns then) instead of refusing it at once."""
        sessions = {info.session_id for info in self.targets.values()}
        if any(self.inflight.busy(session) for session in sessions):
            t0 = time.monotonic()
            still = self.inflight.wait_settled(sessions, self.timeout_s)
            logger.warning(
                "p2p: waited %.1f s for an earlier push's write calls to return before this push: %s",
                time.monotonic() - t0,
                f"still blocked towards session(s) {sorted(still)}, refused" if still else "all returned",
            )
        with self._cond:
            for target, failure in list(self.failed.items()):
                if not self.inflight.busy(failure.session_id):
                    del self.failed[target]

    def submit(self, entries: Iterable[WriteEntry]) -> WriteBatch:
        """Start writing `entries` (one transport call per target, on that target's lane); returns at once."""
        per_target: dict[TargetRank, list[WriteEntry]] = {}
        for entry in entries:
            if entry.nbytes > 0:
                per_target.setdefault(entry.target, []).append(entry)
        batch = WriteBatch(writer=self)
        jobs = [self._job(batch, target, group) for target, group in per_target.items()]
        with self._cond:
            batch.jobs = jobs
            for job in jobs:
                batch.bytes_per_target[job.target] = sum(job.lengths)
                if job.target not in self.failed and self.inflight.busy(job.session_id, other_than=self.token):
                    self.failed[job.target] = TargetFailure(job.target, job.session_id, _STILL_IN_FLIGHT)
                if job.target in self.failed:
                    job.cancelled = job.done = True
            batch._job_finished()
            if not jobs:
                batch.settled.set()
        for job in jobs:
            if not job.done:
                self._lane(job.target).jobs.put(job)
        return batch

    def write(self, entries: Iterable[WriteEntry]) -> None:
        """Submit and wait; raise TransferError naming every target that failed."""
        failures = self.submit(entries).wait()
        if failures:
            raise push_error(failures)

    def _job(self, batch: WriteBatch, target: TargetRank, group: list[WriteEntry]) -> _Job:
        info = self.targets.get(target)
        if info is None:
            raise TransferError(f"{target}: not connected (no published transfer-engine info); reconnect first")
        local: list[int] = []
        remote: list[int] = []
        lengths: list[int] = []
        for e in group:
            param = info.params.get(e.param)
            if param is None or e.offset < 0 or e.offset + e.nbytes > param.nbytes:
                have = "not published" if param is None else f"{param.nbytes} bytes"
                raise RemoteMismatchError(
                    f"engine {target.engine} rank {target.rank} (session {info.session_id}): write of "
                    f"{e.nbytes} bytes at offset {e.offset} into param {e.param!r} ({have}) is out of range; "
                    f"Likely fix: {_MISMATCH_FIX}"
                )
            addr = param.address + e.offset
            if lengths and local[-1] + lengths[-1] == e.local_addr and remote[-1] + lengths[-1] == addr:
                lengths[-1] += e.nbytes  # contiguous on both sides: one range
            else:
                local.append(e.local_addr)
                remote.append(addr)
                lengths.append(e.nbytes)
        return _Job(target, info.session_id, local, remote, lengths, batch)

    def _lane(self, target: TargetRank) -> _Lane:
        lane = self._lanes.get(target)
        if lane is None:
            lane = self._lanes[target] = _Lane(self, target)
        return lane

    def _fail(self, job: _Job, reason: str) -> None:
        """Record the target's failure and cancel its writes that have not started (caller holds _cond)."""
        self.failed.setdefault(job.target, TargetFailure(job.target, job.session_id, reason))
        lane = self._lanes.get(job.target)
        if lane is not None:
            for queued in list(lane.jobs.queue):
                if queued is not None and queued.started is None and not queued.done:
                    queued.cancelled = queued.done = True
                    queued.batch._job_finished()

    def _give_back_worker(self, job: _Job) -> None:
        """The job's call no longer counts against num_workers (caller holds _cond)."""
        if job.holds_worker:
            job.holds_worker = False
            self._workers.release()

    def _expire(self, now: float) -> float | None:
        """Fail every call in flight (any batch) past its deadline and give back its worker, so queued writes
        to other targets can start; the earliest deadline still ahead (caller holds _cond)."""
        ahead = None
        for job in list(self._inflight):
            if not job.holds_worker:
                continue
            deadline = job.started + self.timeout_s
            if now >= deadline:
                self._fail(job, f"write of {sum(job.lengths)} bytes timed out after {self.timeout_s:g} s")
                self._give_back_worker(job)
                self._cond.notify_all()
            else:
                ahead = deadline if ahead is None else min(ahead, deadline)
        return ahead

    def _wait(self, batch: WriteBatch) -> list[TargetFailure]:
        failed: dict[TargetRank, TargetFailure] = {}
        with self._cond:
            while True:
                now = time.monotonic()
                next_deadline = self._expire(now)
                pending = False
                for job in batch.jobs:
                    if job.target in failed or (job.done and job.error is None and not job.cancelled):
                        continue
                    if job.done and job.error is not None:
                        self._fail(job, job.error)
                    elif job.started is not None and not job.done and now - job.started >= self.timeout_s:
                        self._fail(job, f"write of {sum(job.lengths)} bytes timed out after {self.timeout_s:g} s")
                    elif job.target in self.failed and not job.done and job.started is None:
                        job.cancelled = job.done = True  # its target failed in another batch: skip it
                        batch._job_finished()
                    elif not job.cancelled and job.target not in self.failed:
                        pending = True  # started: its deadline is watched by _expire; queued: woken when it starts
                        continue
                    failed[job.target] = self.failed.get(job.target) or TargetFailure(
                        job.target, job.session_id, "skipped: this target failed earlier in the push"
                    )
                if not pending:
                    return [failed[t] for t in sorted(failed)]
                wake = None if next_deadline is None else max(0.0, next_deadline - now) + 1e-3
                self._cond.wait(timeout=wake)

    def close(self) -> None:
        """Stop the idle lanes; a lane blocked in the transport exits when its call returns."""
        for lane in self._lanes.values():
            lane.jobs.put(None)
        self._lanes.clear()


def push_error(failures: Iterable[TargetFailure]) -> TransferError:
    """One TransferError naming every failed target (engine, rank, session) and what to do."""
    failures = list(failures)
    lines = "\n  ".join(f.describe() for f in failures)
    # the first line alone says which targets and why: summaries of several ranks' failures keep only that line
    why = "; ".join(f"{f.target}: {_cut(f.reason)}" for f in failures[:_FIRST_LINE_TARGETS])
    if len(failures) > _FIRST_LINE_TARGETS:
        why += f"; {len(failures) - _FIRST_LINE_TARGETS} more below"
    text = (
        f"weight push failed for {len(failures)} target(s) ({why}); their weights are now unknown:\n  {lines}\n"
        "Check those rollout servers are alive and reachable from this trainer rank (network, RDMA device, "
        "firewall), or raise p2p_transfer_timeout if they are only slow; the next sync must rewrite them."
    )
    unknown = [f.target for f in failures]
    # refused for a call of this rank still in flight: the driver keeps them from every other rank until it returned
    in_flight = [f.target for f in failures if f.reason == _STILL_IN_FLIGHT]
    if in_flight:
        return WriteInFlightError(text, unknown_targets=unknown, in_flight_targets=in_flight)
    return TransferError(text, unknown_targets=unknown)


_FIRST_LINE_TARGETS = 3


def _cut(reason: str, limit: int = 70) -> str:
    """A failure's reason on one short line (the full one is in the lines below it)."""
    line = " ".join(reason.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."

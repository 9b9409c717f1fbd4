"""A guard that makes any collective reaching outside one pipeline stage raise instead of blocking.

The PP-local export promises that no stage waits on another. This turns that promise into a check: while the
guard is active, every `torch.distributed` collective and point-to-point call of this process is inspected
before it runs, and one whose group (or peer) includes a rank outside `stage_ranks` raises
`CrossStageCollectiveError`. Calls inside the stage run normally and are recorded, so a caller can also see
that the in-stage TP/EP gathers really happened.

Scope: the module-level functions of `torch.distributed` (what Megatron-Core and Megatron-Bridge call).
Calls made directly on `ProcessGroup` objects or through functional collectives are not seen.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from verl_p2p.errors import P2PError

# collective / point-to-point functions of torch.distributed and the argument naming a peer (global rank)
GUARDED_OPS: dict[str, tuple[str, ...]] = {
    "broadcast": (),
    "all_reduce": (),
    "all_reduce_coalesced": (),
    "reduce": (),
    "all_gather": (),
    "all_gather_coalesced": (),
    "all_gather_into_tensor": (),
    "_all_gather_base": (),
    "reduce_scatter": (),
    "reduce_scatter_tensor": (),
    "_reduce_scatter_base": (),
    "all_to_all": (),
    "all_to_all_single": (),
    "gather": (),
    "scatter": (),
    "barrier": (),
    "monitored_barrier": (),
    "broadcast_object_list": (),
    "all_gather_object": (),
    "gather_object": (),
    "scatter_object_list": (),
    "send": ("dst",),
    "recv": ("src",),
    "isend": ("dst",),
    "irecv": ("src",),
    "send_object_list": ("dst",),
    "recv_object_list": ("src",),
}


class CrossStageCollectiveError(P2PError):
    """A collective or point-to-point call during a stage-local export involved a rank of another stage."""


@dataclass(frozen=True)
class CollectiveCall:
    """One collective this process issued while guarded: the op and the global ranks it involved."""

    op: str
    ranks: tuple[int, ...]


@dataclass
class GuardLog:
    """What a guard saw: the in-stage calls it let through (outermost calls only)."""

    stage_ranks: frozenset[int]
    calls: list[CollectiveCall] = field(default_factory=list)

    def ops(self) -> set[str]:
        return {c.op for c in self.calls}


_state = threading.local()
_install_lock = threading.Lock()


def _group_ranks(group) -> tuple[int, ...]:
    if group is None:
        group = c10d._get_default_group()
    if not isinstance(group, dist.ProcessGroup):
        raise CrossStageCollectiveError(
            f"a collective was issued on {group!r}, which is not a torch ProcessGroup (a stand-in group leaked "
            "into a communication path)"
        )
    return tuple(dist.get_process_group_ranks(group))


def _involved_ranks(op: str, sig: inspect.Signature, args: tuple, kwargs: dict) -> tuple[int, ...]:
    if op == "batch_isend_irecv":
        ranks: set[int] = set()
        for p2p in args[0] if args else kwargs.get("p2p_op_list", ()):
            ranks.update(_group_ranks(p2p.group))
            ranks.add(int(p2p.peer))
        return tuple(sorted(ranks))
    bound = sig.bind_partial(*args, **kwargs)
    group = bound.arguments.get("group")
    ranks = set(_group_ranks(group))
    for peer_arg in GUARDED_OPS.get(op, ()):
        peer = bound.arguments.get(peer_arg)
        if peer is not None:
            ranks.add(int(peer))
    return tuple(sorted(ranks))


def _wrap(op: str, original: Callable) -> Callable:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        log: GuardLog | None = getattr(_state, "log", None)
        depth = getattr(_state, "depth", 0)
        if log is None or depth > 0:  # not guarding in this thread, or an inner call of an outer checked one
            return original(*args, **kwargs)
        ranks = _involved_ranks(op, sig, args, kwargs)
        outside = sorted(set(ranks) - log.stage_ranks)
        if outside:
            raise CrossStageCollectiveError(
                f"torch.distributed.{op} over ranks {list(ranks)} reaches ranks {outside} outside this pipeline "
                f"stage {sorted(log.stage_ranks)}: a stage-local export must not communicate across stages"
            )
        log.calls.append(CollectiveCall(op, ranks))
        _state.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            _state.depth = depth

    guarded.__p2p_guard_original__ = original  # type: ignore[attr-defined]
    return guarded


@contextlib.contextmanager
def stage_collective_guard(stage_ranks: Iterable[int]) -> Iterator[GuardLog]:
    """While active (in this thread), any collective involving a rank outside `stage_ranks` raises.

    Yields the `GuardLog` of the in-stage calls. Not re-entrant across threads by design: the export runs in one.
    """
    if not dist.is_initialized():
        raise P2PError("stage_collective_guard needs an initialised torch.distributed default group")
    if getattr(_state, "log", None) is not None:
        raise P2PError("stage_collective_guard is already active in this thread")
    log = GuardLog(frozenset(int(r) for r in stage_ranks))
    ops = [*GUARDED_OPS, "batch_isend_irecv"]
    saved: list[tuple[object, str, Callable]] = []
    with _install_lock:
        for op in ops:
            original = getattr(c10d, op, None)
            if original is None:
                continue
            original = getattr(original, "__p2p_guard_original__", original)
            wrapped = _wrap(op, original)
            for namespace in (dist, c10d):
                if getattr(namespace, op, None) is not None:
                    saved.append((namespace, op, getattr(namespace, op)))
                    setattr(namespace, op, wrapped)
    _state.log, _state.depth = log, 0
    try:
        yield log
    finally:
        _state.log = None
        with _install_lock:
            for namespace, op, original in reversed(saved):
                setattr(namespace, op, original)

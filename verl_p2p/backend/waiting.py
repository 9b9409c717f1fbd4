"""Waiting for a round of calls to the trainer ranks (or verl's server actors) with a deadline.

One helper for every round the driver sends (prepare, init_process_group, the push, verl's version stamp): each
call's value, its exception, or a `LateError` naming the call that did not answer in time. Ray alone would
wait forever for a rank hung in its export's collectives, and `ray.get` of a list raises only the first error,
which for a dead rank names no target.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from verl_p2p.errors import LateError, error_chain, first_line

logger = logging.getLogger(__name__)


def trainer_rank(index: int) -> str:
    return f"trainer rank {index}"


async def wait_each(
    calls: Iterable[Any],
    deadline_s: float,
    needed: Iterable[int] | None = None,
    who: Callable[[int], str] = trainer_rank,
) -> list[Any]:
    """Each call's value or exception, in order: Ray ObjectRefs (waited for off the event loop), awaitables or
    plain values. Returns once every `needed` call (default: all) answered, or `deadline_s` passed: a needed call
    still running then is a `LateError`; another call not answered by then is one too (not waited for)."""
    calls = list(calls or [])
    if not calls:
        return []
    wanted = sorted(set(range(len(calls)) if needed is None else needed))
    import ray

    if all(isinstance(c, ray.ObjectRef) for c in calls):
        return await asyncio.to_thread(_wait_refs, calls, deadline_s, wanted, who)
    tasks = [asyncio.ensure_future(c if inspect.isawaitable(c) else _value(c)) for c in calls]
    if wanted:
        await asyncio.wait([tasks[i] for i in wanted], timeout=deadline_s)
    out: list[Any] = []
    for i, task in enumerate(tasks):
        if not task.done():
            task.cancel()
            out.append(_late(who(i), deadline_s))
        elif task.cancelled():
            out.append(asyncio.CancelledError(f"{who(i)}: its call was cancelled"))
        else:
            out.append(task.exception() or task.result())
    return out


def failed_ranks_text(failed: Sequence[tuple[int, BaseException]], who: Callable[[int], str] = trainer_rank) -> str:
    """`who: Type: first line` for each failed call, joined: one message naming every failure once."""
    return "; ".join(f"{who(i)}: {describe(e)}" for i, e in failed)


def describe(error: BaseException) -> str:
    """`Type: first line` of what a call raised: out of Ray's RayTaskError (whose own first line names only the
    worker process), the exception the rank itself raised."""
    own = next((e for e in error_chain(error) if not isinstance(e, ray_wrappers())), error)
    return f"{type(own).__name__}: {first_line(own)}"


def ray_wrappers() -> tuple[type, ...]:
    """The exception types Ray wraps a remote call's own exception in (its `cause`): what the driver looks through."""
    try:
        from ray.exceptions import RayTaskError
    except ImportError:  # pragma: no cover - the driver runs under Ray
        return ()
    return (RayTaskError,)


def _wait_refs(refs: list[Any], deadline_s: float, wanted: list[int], who: Callable[[int], str]) -> list[Any]:
    import ray

    end = time.monotonic() + deadline_s
    pending = [refs[i] for i in wanted]
    while pending:
        left = end - time.monotonic()
        if left <= 0:
            break
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=left)
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    ready_ids = {r.hex() for r in ready}
    out: list[Any] = []
    for i, ref in enumerate(refs):
        if ref.hex() not in ready_ids:
            out.append(_late(who(i), deadline_s))
            _settle_late(ref, who(i))
            continue
        try:
            out.append(ray.get(ref))
        except Exception as exc:  # noqa: BLE001 - each call's outcome is reported
            out.append(exc)
    return out


def _settle_late(ref: Any, name: str) -> None:
    """Take a late call's outcome when it comes, and log it on one line: a result nobody takes, Ray prints as an
    "Unhandled error" traceback in the driver's log, which reads like a second failure."""

    def taken(future: Any) -> None:
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - reported, never raised: the sync has moved on
            logger.warning("p2p: %s failed after its deadline: %s", name, describe(exc))
        else:
            logger.info("p2p: %s answered after its deadline", name)

    ref.future().add_done_callback(taken)


def _late(name: str, deadline_s: float) -> LateError:
    return LateError(
        f"{name} did not answer within {deadline_s:g} s (hung, e.g. in its export's collectives, or unreachable; "
        "its call may still be running)"
    )


async def _value(value: Any) -> Any:
    return value

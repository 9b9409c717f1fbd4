"""Exception types: every failure names the thing that failed and, where there is one, the fix."""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any


class P2PError(RuntimeError):
    """Base class of every error this backend raises on purpose.

    Picklable whatever a subclass's constructor takes: Ray sends a worker's exception to the driver by pickle,
    and an exception that cannot be rebuilt there arrives as "Failed to deserialize exception", its message lost.
    Its `__cause__` travels with it (plain pickling drops it): the driver reads what a trainer rank's push error
    wraps (the targets it named, a go/no-go refusal, a write still in flight) to decide what a re-push may ask.
    """

    def __reduce__(self):
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__), _portable_cause(self.__cause__)))


def _rebuild_error(cls: type, args: tuple, state: dict, cause: BaseException | None = None) -> BaseException:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    error.__cause__ = cause
    return error


def _portable_cause(cause: BaseException | None) -> BaseException | None:
    """`cause` as it can travel with its error: itself when it pickles, else a P2PError with its type and text."""
    if cause is None or isinstance(cause, P2PError):
        return cause
    try:
        pickle.dumps(cause)
    except Exception:  # noqa: BLE001 - any exception that cannot be pickled travels as its text
        return P2PError(f"{type(cause).__name__}: {cause}")
    return cause


class P2PConfigError(P2PError, ValueError):
    """A bad `engine_kwargs.verl_p2p` key or value, or a rollout server setting p2p cannot work with."""


class UnsupportedLayoutError(P2PError):
    """A rollout layout the trainer-side replica cannot reproduce byte for byte."""


class RemoteMismatchError(P2PError):
    """A target's published weights disagree with what the trainer would write (name, numel, element size)."""


class TransferError(P2PError):
    """A write to a target failed or timed out; the target's bytes are unknown afterwards.

    `unknown_targets`: the rollout targets (TargetRank) whose bytes the failed push left unknown, when the raiser
    knows them: every other target of that push then received all its bytes. None: not known, so every target
    of the push counts as unknown. The attribute survives pickling (Ray carries it to the driver).
    """

    def __init__(self, message: str, unknown_targets: Iterable[Any] | None = None):
        super().__init__(message)
        self.unknown_targets = None if unknown_targets is None else frozenset(unknown_targets)


class PushError(TransferError):
    """A sync's push failed on one or more trainer ranks; `unknown_targets` gathers what every rank left unknown."""


class RolloutHTTPError(P2PError):
    """A rollout server answered an error, or did not answer in time."""


class WriteInFlightError(TransferError):
    """A push that refused targets because a write call to them from an earlier push is still in flight (blocked
    in the transport) and may still land. `in_flight_targets`: those targets; no other rank may write them until
    that call returned (its older bytes would land over the newer ones)."""

    def __init__(
        self, message: str, unknown_targets: Iterable[Any] | None = None, in_flight_targets: Iterable[Any] = ()
    ):
        super().__init__(message, unknown_targets)
        self.in_flight_targets = frozenset(in_flight_targets)


def error_chain(error: BaseException) -> list[BaseException]:
    """`error` and every exception behind it, nearest first: Ray's RayTaskError `cause` and `raise ... from`."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    todo: list[BaseException | None] = [error]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        chain.append(exc)
        todo += [getattr(exc, "cause", None), exc.__cause__]
    return chain


def unknown_targets_of(error: BaseException) -> frozenset | None:
    """The `unknown_targets` a failed push's exception carries (also inside Ray's RayTaskError and through
    `raise ... from`); None when no exception in the chain knows them."""
    for exc in error_chain(error):
        targets = getattr(exc, "unknown_targets", None)
        if isinstance(targets, frozenset):
            return targets
    return None


def in_flight_targets_of(error: BaseException) -> frozenset:
    """Every target a failed push refused because a write call to it is still in flight (WriteInFlightError)."""
    found: frozenset = frozenset()
    for exc in error_chain(error):
        targets = getattr(exc, "in_flight_targets", None)
        if isinstance(targets, frozenset):
            found |= targets
    return found


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an error's message (its type's name when empty), cut at `limit` characters: what a
    summary naming several failures shows of each."""
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:limit]


class LateError(P2PError, TimeoutError):
    """A trainer rank did not answer a driver round within its deadline (`p2p_push_deadline_s`,
    `p2p_prepare_deadline_s`): hung in its export's collectives, or unreachable. Its call may still be running."""


class MalformedAnswerError(P2PError, ValueError):
    """A rollout server's answer (server info, rank info) lacks the documented shape or holds impossible values."""


class QuantizationError(P2PError, ValueError):
    """A tensor the rollout stores as FP8 cannot be quantized (NaN/inf, wrong rank or dtype), or a checkpoint's
    quantization is one the trainer's quantizer cannot reproduce byte for byte."""


class ReplicaLoadError(P2PError):
    """A load request the replica cannot serve as asked (wrong buffer, missing or misshaped feeds, a plan made for
    another floating type)."""

"""Exception types: every failure names the thing that failed and, where there is one, the fix."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class P2PError(RuntimeError):
    """Base class of every error this backend raises on purpose.

    Picklable whatever a subclass's constructor takes: Ray sends a worker's exception to the driver by pickle,
    and an exception that cannot be rebuilt there arrives as "Failed to deserialize exception", its message lost.
    """

    def __reduce__(self):
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


def _rebuild_error(cls: type, args: tuple, state: dict) -> BaseException:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


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


def unknown_targets_of(error: BaseException) -> frozenset | None:
    """The `unknown_targets` a failed push's exception carries (also inside Ray's RayTaskError and through
    `raise ... from`); None when no exception in the chain knows them."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        targets = getattr(exc, "unknown_targets", None)
        if isinstance(targets, frozenset):
            return targets
        todo += [getattr(exc, "cause", None), exc.__cause__]
    return None


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

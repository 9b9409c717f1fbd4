"""What a rollout rank publishes about its registered weight memory, as the trainer side sees it.

Parsing is strict: an answer that is not exactly `[session_id, {name: [address, numel, element_size]}, ...]`
with a `host:port` session, positive addresses, whole sizes and a real element size raises
`MalformedAnswerError` naming the field, never a bare KeyError/TypeError, so nothing is planned from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from verl_p2p.errors import MalformedAnswerError

ELEMENT_SIZES = frozenset({1, 2, 4, 8})
ADDRESS_LIMIT = 1 << 64
ANSWER_KEY = "remote_instance_transfer_engine_info"
EXPECTED = f"expected {{'{ANSWER_KEY}': [session_id 'host:port', {{param: [address, numel, element_size]}}]}}"


@dataclass(frozen=True, order=True)
class TargetRank:
    """One rank of one rollout engine (replica); `engine` is the replica index."""

    engine: int
    rank: int

    def __str__(self) -> str:
        return f"engine {self.engine} rank {self.rank}"


@dataclass(frozen=True)
class RemoteParam:
    """One registered parameter of a rollout rank: where it lives and how big it is."""

    address: int
    numel: int
    element_size: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def problem(self) -> str | None:
        """What makes this entry impossible (a range no real registration has), or None."""
        for what, value in (("address", self.address), ("numel", self.numel), ("element_size", self.element_size)):
            if not _is_int(value):
                return f"{what} {value!r} is not an integer"
        if self.element_size not in ELEMENT_SIZES:
            return f"element_size {self.element_size} is not one of {sorted(ELEMENT_SIZES)}"
        if self.numel < 0:
            return f"numel {self.numel} is negative"
        if self.address <= 0:
            return f"address {self.address} is not a positive address"
        if self.address + self.nbytes > ADDRESS_LIMIT:
            return f"range [{self.address:#x}, +{self.nbytes}) runs past the 64-bit address space"
        return None


@dataclass(frozen=True)
class RemoteRankInfo:
    """A rollout rank's Mooncake session and weights, from `/get_transfer_engine_info?rank=r`."""

    session_id: str
    params: Mapping[str, RemoteParam] = field(default_factory=dict)

    @classmethod
    def from_json(cls, answer: Any) -> RemoteRankInfo:
        """Parse the bootstrap/control-plane answer; later releases may append list elements: ignore them.
        Raises MalformedAnswerError naming what is wrong."""
        if not isinstance(answer, Mapping):
            raise MalformedAnswerError(f"rank info is a {type(answer).__name__}, not a JSON object; {EXPECTED}")
        if ANSWER_KEY not in answer:
            raise MalformedAnswerError(
                f"rank info has no {ANSWER_KEY!r} (keys {sorted(map(str, answer))[:8]}); {EXPECTED}"
            )
        info = answer[ANSWER_KEY]
        if not isinstance(info, (list, tuple)) or len(info) < 2:
            raise MalformedAnswerError(f"{ANSWER_KEY} is {_short(info)}, not a list [session_id, weights, ...]")
        if "rank" in answer and not _is_int(answer["rank"]):
            raise MalformedAnswerError(f"rank info's rank {_short(answer['rank'])} is not an integer")
        session_id = check_session_id(info[0])
        weights = info[1]
        if not isinstance(weights, Mapping):
            raise MalformedAnswerError(f"session {session_id}: weights info is {_short(weights)}, not an object")
        if not weights:
            raise MalformedAnswerError(f"session {session_id} publishes no parameters (an empty weights info)")
        params = {}
        for name, value in weights.items():
            if not isinstance(name, str) or not name:
                raise MalformedAnswerError(f"session {session_id}: parameter name {_short(name)} is not a name")
            if not isinstance(value, (list, tuple)) or len(value) < 3:
                raise MalformedAnswerError(
                    f"session {session_id}: parameter {name!r} is {_short(value)}, not [address, numel, element_size]"
                )
            param = RemoteParam(value[0], value[1], value[2])
            problem = param.problem()
            if problem is not None:
                raise MalformedAnswerError(f"session {session_id}: parameter {name!r}: {problem}")
            params[name] = param
        overlaps = overlapping(params.items())
        if overlaps:
            raise MalformedAnswerError(f"session {session_id}: published parameters overlap: {overlaps[0]}")
        return cls(session_id=session_id, params=params)

    def fingerprint(self) -> tuple:
        """Changes whenever the session or any address/size changes: the reconnect trigger."""
        return (self.session_id, tuple(sorted((k, v.address, v.numel, v.element_size) for k, v in self.params.items())))


def check_session_id(value: Any) -> str:
    """A Mooncake P2P session id `host:port` (IPv6 hosts too); raises MalformedAnswerError otherwise."""
    if not isinstance(value, str) or not value.strip():
        raise MalformedAnswerError(f"session id {_short(value)} is not a 'host:port' string")
    host, sep, port = value.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 1 <= int(port) <= 65535 or value != value.strip():
        raise MalformedAnswerError(f"session id {value[:80]!r} is not 'host:port' with a TCP port")
    return value


def overlapping(params: Iterable[tuple[str, RemoteParam]]) -> list[str]:
    """Pairs of parameters whose published byte ranges overlap (described), in address order."""
    spans = sorted((p.address, p.address + p.nbytes, name) for name, p in params if p.nbytes > 0)
    found = []
    end, last = None, None
    for start, stop, name in spans:
        if end is not None and start < end:
            found.append(f"{name!r} [{start:#x}, {stop:#x}) starts inside {last!r} (ends {end:#x})")
        if end is None or stop > end:
            end, last = stop, name
    return found


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"

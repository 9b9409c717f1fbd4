"""What a rollout rank publishes about its registered weight memory, as the trainer side sees it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


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


@dataclass(frozen=True)
class RemoteRankInfo:
    """A rollout rank's Mooncake session and weights, from `/get_transfer_engine_info?rank=r`."""

    session_id: str
    params: Mapping[str, RemoteParam] = field(default_factory=dict)

    @classmethod
    def from_json(cls, answer: Mapping[str, Any]) -> RemoteRankInfo:
        """Parse the bootstrap/control-plane answer; later releases may append list elements: ignore them."""
        info = answer["remote_instance_transfer_engine_info"]
        session_id, weights = info[0], info[1]
        params = {name: RemoteParam(int(v[0]), int(v[1]), int(v[2])) for name, v in weights.items()}
        return cls(session_id=str(session_id), params=params)

    def fingerprint(self) -> tuple:
        """Changes whenever the session or any address/size changes: the reconnect trigger."""
        return (self.session_id, tuple(sorted((k, v.address, v.numel, v.element_size) for k, v in self.params.items())))

"""Which part of a sync an engine plays, found from verl 0.9.1's own construction of it.

verl builds the backend in two places, with different arguments:

- trainer: `ActorRolloutRefWorker.init_model` calls `CheckpointEngineRegistry.new(backend, is_master=...,
  bucket_size=..., **engine_kwargs)`: `is_master` is present. After the plan, a trainer rank is a *source*
  (it writes to targets) or *idle* (it only takes part in the export's collectives).
- rollout: `CheckpointEngineWorker.__init__` calls `CheckpointEngineRegistry.new(backend, bucket_size=...,
  **engine_kwargs)`: no `is_master`. The worker's `server_adapter` (SGLang `ServerAdapter`) knows the replica
  and the rank inside it; rank 0 is the *leader* (it talks to its SGLang server), the others are *followers*.

Finding the constructing worker walks a few stack frames once, at construction; everything else is lazy.
"""

from __future__ import annotations

import enum
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any

from verl_p2p.errors import P2PConfigError

_MAX_FRAMES = 12


class Side(str, enum.Enum):
    TRAINER = "trainer"
    ROLLOUT = "rollout"


class Role(str, enum.Enum):
    TRAINER = "trainer"  # a trainer rank before the plan said source or idle
    TRAINER_SOURCE = "trainer_source"
    TRAINER_IDLE = "trainer_idle"
    ROLLOUT_LEADER = "rollout_leader"
    ROLLOUT_FOLLOWER = "rollout_follower"


def find_owner_worker(skip: int = 1) -> Any | None:
    """The verl `Worker` whose method is constructing us (nearest `self` up the stack), or None."""
    worker_cls = _worker_class()
    if worker_cls is None:
        return None
    frame = sys._getframe(skip + 1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, worker_cls):
            return owner
        frame = frame.f_back
    return None


def _worker_class() -> type | None:
    module = sys.modules.get("verl.single_controller.base.worker")
    return getattr(module, "Worker", None)


def side_of(is_master: bool | None, owner: Any | None) -> Side:
    """Trainer when verl passed `is_master` (only its actor workers do); confirmed by the owner's type."""
    if owner is not None and type(owner).__name__ == "CheckpointEngineWorker":
        return Side.ROLLOUT
    return Side.TRAINER if is_master is not None else Side.ROLLOUT


def weak(owner: Any | None) -> weakref.ReferenceType | None:
    if owner is None:
        return None
    try:
        return weakref.ref(owner)
    except TypeError:  # pragma: no cover - verl workers are ordinary classes
        return lambda: owner


@dataclass(frozen=True)
class TrainerIdentity:
    """A trainer rank: its global rank and the pipeline stage it holds."""

    rank: int
    world_size: int
    pp_stage: int
    pp_size: int


def trainer_identity() -> TrainerIdentity:
    """From torch.distributed and, when Megatron's parallel state is initialised, its pipeline rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    pp_stage, pp_size = 0, 1
    mpu = sys.modules.get("megatron.core.parallel_state")  # imported by the Megatron engine, never by us
    if mpu is not None and mpu.model_parallel_is_initialized():
        pp_stage = mpu.get_pipeline_model_parallel_rank()
        pp_size = mpu.get_pipeline_model_parallel_world_size()
    return TrainerIdentity(rank=rank, world_size=world, pp_stage=pp_stage, pp_size=pp_size)


@dataclass(frozen=True)
class RolloutIdentity:
    """A rollout worker: verl's replica rank (the `engine` of its targets) and its rank inside the replica."""

    replica_rank: int
    rank_in_replica: int
    rollout_name: str | None = None

    @property
    def role(self) -> Role:
        return Role.ROLLOUT_LEADER if self.rank_in_replica == 0 else Role.ROLLOUT_FOLLOWER


def rollout_identity(owner: Any | None) -> RolloutIdentity:
    """From the owning CheckpointEngineWorker's server adapter (what verl itself uses), else its kwargs/env."""
    if owner is None:
        raise P2PConfigError(
            "p2p rollout engine was not built by verl's CheckpointEngineWorker, so its replica is unknown: "
            "build it through CheckpointEngineRegistry.new inside CheckpointEngineWorker (verl 0.9.1 standalone/"
            "colocated rollout replicas do)"
        )
    config = getattr(owner, "rollout_config", None)
    name = getattr(config, "name", None)
    if name not in (None, "sglang"):
        raise P2PConfigError(
            f"checkpoint_engine.backend=verl_p2p needs actor_rollout_ref.rollout.name=sglang, got {name!r}: "
            "p2p writes into SGLang's registered weight memory"
        )
    adapter = getattr(owner, "server_adapter", None)
    replica = getattr(adapter, "replica_rank", None)
    rank = getattr(adapter, "rollout_rank", None)
    if replica is None:
        replica = (getattr(owner, "extra_rollout_kwargs", None) or {}).get("replica_rank")
    if rank is None:
        rank = int(os.environ.get("RANK", 0))  # verl gives every replica its own worker group
    if replica is None or int(replica) < 0:
        raise P2PConfigError(f"p2p rollout engine: replica rank unknown (worker {owner!r} has no replica_rank)")
    return RolloutIdentity(replica_rank=int(replica), rank_in_replica=int(rank), rollout_name=name)

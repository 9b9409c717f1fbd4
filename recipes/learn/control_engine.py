"""The negative control of the learning runs: a STAND-IN checkpoint engine that never updates the rollout's weights.

Registered in verl's CheckpointEngineRegistry as `control` when verl imports this module
(`checkpoint_engine.custom_backend_module=control_engine`, with recipes/learn on PYTHONPATH: recipes/tiny/tiny_args.sh
sets both for BACKEND=control). verl's stock manager then runs every step of a sync as with a real engine (abort,
prepare, topology, send, receive, finalize, resume); the trainer's export is read to the end (so every trainer rank
runs the same collectives as with a real engine), but nothing is written and the rollout receives no tensor. A
rollout on its first weights must not learn: a rising reward under this engine would mean the curve does not depend
on the sync. It lives in the recipe's harness, never in the verl_p2p package.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

BACKEND = "control"
DROPPED = "checkpoint_engine/control/tensors_dropped"


@CheckpointEngineRegistry.register(BACKEND)
class NoSyncCheckpointEngine(CheckpointEngine):
    """verl's CheckpointEngine interface with every transfer left out (the stand-in for "the sync is cut")."""

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        if engine_kwargs:
            raise ValueError(
                f"checkpoint_engine.backend={BACKEND} takes no engine_kwargs.{BACKEND} options, got "
                f"{sorted(engine_kwargs)}: remove them"
            )
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.dropped = 0

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        return {}, {}

    def init_process_group(self, **kwargs) -> None:
        pass

    def finalize(self) -> None:
        pass

    async def send_weights(
        self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None
    ) -> dict[str, float]:
        """Read the trainer's export to its end and drop it; the count is the step's metric."""
        self.dropped = sum(1 for _ in weights)
        return {DROPPED: float(self.dropped)}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Nothing arrives: the rollout's server adapter loads no tensor and keeps its weights."""
        return
        yield  # an async generator, as verl's engines' receive_weights are

"""Trainer ranks of a real gloo world as Ray actors, one per rank, for P2PCheckpointEngineManager to drive
(tests/test_manager_stalled_export.py): each holds a real P2PCheckpointEngine whose push is the real SourceSession.

Real: the gloo world and the trainer's own groups (tests/support/stalled_export.py's `init_rank`: Megatron-Bridge
TP2 x DP2 inside verl's MegatronEngine class, or an HF model under FSDP2 `fully_shard` inside verl's FSDP engine
class), verl's `Worker` base (the checkpoint engine is built inside a method of it, so it finds its owner worker as
in verl, and from it the engine at `actor.engine`), the checkpoint-engine registry and P2PCheckpointEngine (prepare,
init_process_group, send_weights with `driver_collects`), SourceSession (go/no-go over p2p's bounded groups, the
PP-local export or FSDP's full-tensor stream, Mooncake tcp writes), the signals, Ray actors.

Stand-in, named as such: `ExportRankWorker` for verl's ActorRolloutRefWorker (role "actor"): it holds the model
that `init_rank` builds instead of building an optimizer and a full engine (CUDA only). Its `update_weights` hands
`send_weights` what verl's worker hands it: FSDP, the engine's `get_per_tensor_param()` generator (the stream);
Megatron, none (p2p's Megatron path never iterates it). The worker group is tests/support/deadline_ranks.py's
`RayActorGroupStandIn` (one Ray call per rank, as verl's group returns them).
"""

from __future__ import annotations

import os
import time
from typing import Any

from verl.single_controller.base import Worker

from support.stalled_export import Trainer, init_rank, signalled_in_stream


class ExportRankWorker(Worker):
    """One trainer rank (see the module docstring). `arm(sig, after)`: its next push sends it `sig` after `after`
    streamed tensors; `pushed()`: how its last push ended, as the rank itself saw it."""

    def __init__(self, rank: int, trainer: Trainer, options: dict[str, Any]) -> None:
        from verl.checkpoint_engine import CheckpointEngineRegistry

        import verl_p2p.backend.engine  # noqa: F401 - registers the p2p engine
        from support.fsdp_ranks import actor_worker

        _, engine = init_rank(rank, trainer)  # sets RANK, WORLD_SIZE, MASTER_ADDR/PORT, as verl's group does
        Worker.__init__(self)
        self.actor = actor_worker(engine).actor  # verl's TrainingWorker holding the engine (`worker.actor.engine`)
        self.full_stream = trainer.kind == "fsdp"
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            "p2p", is_master=rank == 0, bucket_size=1 << 20, **options
        )  # fmt: skip
        self.fault: tuple[int, int] | None = None
        self.last: tuple[str, float] | None = None

    def ready(self) -> int:
        """The process id, once built (a call queued behind a running one answers only after it)."""
        return os.getpid()

    def arm(self, sig: int, after: int) -> None:
        self.fault = (sig, after)

    def held(self) -> dict[str, Any]:
        """This rank's current assignment, as the driver planned it."""
        a = self.checkpoint_engine._assignment
        return {"targets": tuple(a.targets), "stage_ranks": a.stage_ranks, "export": a.export}

    def pushed(self) -> tuple[str, float] | None:
        """(outcome: "ok" or "ErrorType: message", seconds) of the last push; queued behind a push still running."""
        return self.last

    def execute(self, method: str, kwargs: dict) -> Any:
        return getattr(self.checkpoint_engine, method)(**kwargs)

    async def update_weights(self, global_steps: int | None) -> Any:
        fault, self.fault = self.fault, None
        weights = self.actor.engine.get_per_tensor_param()[0] if self.full_stream else None
        t0 = time.monotonic()
        try:
            with signalled_in_stream(self.checkpoint_engine._session, fault):
                out = await self.checkpoint_engine.send_weights(weights, global_steps=global_steps)
        except Exception as exc:
            self.last = (f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
            raise
        self.last = ("ok", time.monotonic() - t0)
        return out

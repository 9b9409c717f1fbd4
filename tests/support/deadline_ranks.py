"""Trainer ranks whose export can die or hang, for the deadline tests (tests/test_push_deadline.py).

Real: the P2PCheckpointEngine of every rank (its hooks, its outcome reporting, its gloo outcome-exchange group),
the processes (Ray actors, or torch.multiprocessing with gloo), SIGKILL.

Stand-ins, each named as such:
- `ExportingSessionStandIn` for verl_p2p.trainer.source.SourceSession: its push runs an "export" step (where
  Megatron-Bridge's export runs in the real session) that the test makes die (SIGKILL) or hang, then counts the
  targets of its assignment as written (no Mooncake writes: the rollouts are tests/support/fake_sglang.py).
  It runs no collective, so each rank reports that it exports alone (`export_peers`: itself, as a Megatron TP1
  data-parallel copy would): a re-push around a dead rank is planned as for DP copies. This test shows the
  manager's deadline arithmetic and planning only: that the real go/no-go runs without a dead or stalled rank and
  that its TP peers are cut off is shown in a real gloo world by tests/test_stalled_rank_go_no_go.py; a rank killed or
  stopped inside the real export by tests/test_stalled_rank_export.py (the test as the driver) and
  tests/test_manager_stalled_export.py (this manager driving real ranks).
- `RayActorGroupStandIn` for verl's actor RayWorkerGroup: its two entry points the manager calls, one Ray call
  per rank (as verl's group returns them).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

HANG_S = 45.0  # a hung export: long past every deadline of the tests, short enough to end on its own


class ExportingSessionStandIn:
    """Stand-in for SourceSession (see the module docstring). `fault`: ("kill" | "hang", push number), ("plan",
    assignment number) or None."""

    fault: tuple[str, int] | None = None

    def __init__(self, config: Any, owner: Any, hostname: Any = None, checkpoint_engine: Any = None) -> None:
        self.applied: list[Any] = []
        self.pushes = 0

    def apply(self, assignment: Any) -> None:
        """Where the real session builds its replicas and checks its programs: a "plan" fault hangs here."""
        self.applied.append(assignment)
        if self.fault is not None and self.fault == ("plan", len(self.applied)):
            time.sleep(HANG_S)

    def push(self, weights: Any = None) -> dict:
        self.pushes += 1
        self._export()
        targets = self.applied[-1].targets
        return {"bytes": 100.0 * len(targets), "num_targets": float(len(targets)), "seconds/total": 0.01}

    def _export(self) -> None:
        """Where the real session streams Megatron-Bridge's export: the fault lands here."""
        if self.fault is None or self.fault[1] != self.pushes:
            return
        if self.fault[0] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(HANG_S)

    def close(self) -> None:
        pass


def trainer_engine(rank: int, world: int, options: dict, fault: tuple[str, int] | None) -> Any:
    """A real P2PCheckpointEngine of trainer rank `rank` over the session stand-in."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import verl_p2p.backend.engine  # noqa: F401 - registers the engine
    import verl_p2p.trainer.source as source
    from verl_p2p.backend.roles import TrainerIdentity

    source.SourceSession = ExportingSessionStandIn
    ExportingSessionStandIn.fault = fault
    engine = CheckpointEngineRegistry.new("p2p", is_master=rank == 0, bucket_size=1 << 20, **options)
    engine._trainer = TrainerIdentity(rank=rank, world_size=world, pp_stage=0, pp_size=1)
    engine._peers = ((rank,),)  # exports alone (see ExportingSessionStandIn): its SourceMeta.export_peers
    return engine


class TrainerRankActor:
    """One trainer rank in its own process (a Ray actor): verl's checkpoint-engine calls on a real engine."""

    def __init__(self, rank: int, world: int, options: dict, fault: tuple[str, int] | None = None) -> None:
        self.rank, self.world = rank, world
        self.engine = trainer_engine(rank, world, options, fault)

    def reset(self, options: dict, fault: tuple[str, int] | None = None) -> bool:
        """A new engine in this same process, for the next test: a healthy rank's process is reused (its start,
        imports included, is seconds on a busy 2-core host); a faulted one is never reused."""
        self.engine = trainer_engine(self.rank, self.world, options, fault)
        return True

    def ready(self) -> bool:
        """Answers once the process is up (its start is no part of a deadline under test)."""
        return True

    def execute(self, method: str, kwargs: dict) -> Any:
        return getattr(self.engine, method)(**kwargs)

    async def update_weights(self, global_steps: int | None) -> Any:
        return await self.engine.send_weights(None, global_steps=global_steps)


def start_rank(actor_class: type, *args: Any) -> Any:
    """One trainer rank as a Ray actor of `actor_class`: one CPU and one call at a time, as verl's worker actors."""
    import ray

    return ray.remote(actor_class).options(num_cpus=1, max_concurrency=1).remote(*args)


class RayActorGroupStandIn:
    """Stand-in for verl's actor RayWorkerGroup (see the module docstring)."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self.world_size = len(actors)

    def execute_checkpoint_engine(self, method: list[str], **kwargs: Any) -> list[Any]:
        return [
            actor.execute.remote(name, {k: v[i] for k, v in kwargs.items()})
            for i, (actor, name) in enumerate(zip(self.actors, method, strict=True))
        ]

    def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> list[Any]:
        assert mode == "p2p"
        return [actor.update_weights.remote(global_steps) for actor in self.actors]


def gloo_rank(rank: int, world: int, port: int, options: dict, assignment: Any, fault: Any, out: Any) -> None:
    """One trainer rank of the engine-only path (torch.multiprocessing): gloo world, real engine, one push;
    puts (rank, seconds, error type, message, unknown targets) on `out`."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    engine = trainer_engine(rank, world, options, fault)
    engine.init_process_group(assignment=assignment)
    t0 = time.monotonic()
    try:
        asyncio.run(engine.send_weights(None, global_steps=1))
        out.put((rank, time.monotonic() - t0, None, "", None))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        unknown = getattr(exc, "unknown_targets", None)
        out.put((rank, time.monotonic() - t0, type(exc).__name__, str(exc), None if unknown is None else set(unknown)))

"""Reaching verl 0.9.1's Megatron engine from its real worker classes, and the checkpoint-save hook.

verl's workers and MegatronEngine cannot be initialised on a CPU host (they build CUDA models), so instances of
the real classes are made with `object.__new__` and given the attributes `init_model()` would set. That runs in
one spawned process: importing MegatronEngine needs the transformer_engine import stub, which must not leak into
the pytest process.
"""

from __future__ import annotations

import pytest

from verl_p2p.sandbox.cpu_megatron import run_group


class _Recorder:
    """Transfer-buffer stand-in that records the order of calls (the real TransferBuffers has these two)."""

    def __init__(self, events: list[str]):
        self.events = events

    def release(self) -> None:
        self.events.append("release")

    def restore(self) -> None:
        self.events.append("restore")


def _verl_checks(rank: int, world: int, port: int) -> dict:
    from verl_p2p.sandbox.cpu_megatron import install_te_stub

    install_te_stub()
    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.workers.engine.fsdp import FSDPEngine
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    from verl_p2p.trainer.verl_engine import (
        EngineAccessError,
        find_megatron_engine,
        find_owning_worker,
        release_buffers_around_save,
    )

    out: dict = {}

    def error_of(fn) -> str:
        try:
            fn()
        except EngineAccessError as err:
            return str(err)
        return ""

    engine = object.__new__(MegatronEngine)
    actor = object.__new__(TrainingWorker)
    actor.engine = engine
    worker = object.__new__(ActorRolloutRefWorker)
    worker.actor = actor
    checkpoint_engine = object()  # stands in for P2PCheckpointEngine: only its identity matters here
    worker.checkpoint_engine = checkpoint_engine
    out["via_actor_worker"] = find_megatron_engine(worker) is engine
    out["via_training_worker"] = find_megatron_engine(actor) is engine
    out["engine_itself"] = find_megatron_engine(engine) is engine
    out["owning_worker"] = find_owning_worker(checkpoint_engine) is worker
    detached = object.__new__(DetachActorWorker)
    detached.actor, detached.checkpoint_engine = actor, object()
    out["owning_subclass_worker"] = find_owning_worker(detached.checkpoint_engine) is detached
    out["no_owner_error"] = error_of(lambda: find_owning_worker(object()))

    before_init = object.__new__(ActorRolloutRefWorker)
    before_init.actor = None
    out["before_init_error"] = error_of(lambda: find_megatron_engine(before_init))
    fsdp_actor = object.__new__(TrainingWorker)
    fsdp_actor.engine = object.__new__(FSDPEngine)
    fsdp_worker = object.__new__(ActorRolloutRefWorker)
    fsdp_worker.actor = fsdp_actor
    out["fsdp_error"] = error_of(lambda: find_megatron_engine(fsdp_worker))

    # the save hook on a real MegatronEngine instance, reached through verl's real TrainingWorker.save_checkpoint
    events: list[str] = []
    original_class_save = MegatronEngine.save_checkpoint
    engine.__dict__["save_checkpoint"] = lambda *a, **k: events.append(f"save {a[0]} step={a[2]}")  # verl's body
    first_events: list[str] = []
    release_buffers_around_save(engine, _Recorder(first_events))
    hook = release_buffers_around_save(engine, _Recorder(events))  # re-install: replaces, does not stack
    TrainingWorker.save_checkpoint(actor, "/ckpt", None, 7)
    out["save_order"] = list(events)
    out["class_untouched"] = MegatronEngine.save_checkpoint is original_class_save
    out["first_replaced"] = first_events == []  # the earlier hook's buffers are no longer touched

    events.clear()

    def failing_save(*a, **k):
        events.append("save")
        raise OSError("disk full")

    hook.remove()
    out["removed_restores_previous"] = not hasattr(engine.__dict__["save_checkpoint"], "__p2p_save_hook__")
    engine.__dict__["save_checkpoint"] = failing_save
    release_buffers_around_save(engine, _Recorder(events))
    try:
        actor.save_checkpoint("/ckpt", None, 8)
        out["error_propagated"] = False
    except OSError:
        out["error_propagated"] = True
    out["error_order"] = list(events)
    return out


@pytest.fixture(scope="module")
def verl_results() -> dict:
    return run_group(_verl_checks, 1, timeout_s=180)[0]


def test_engine_found_on_the_real_worker_classes(verl_results):
    assert verl_results["via_actor_worker"] and verl_results["via_training_worker"] and verl_results["engine_itself"]


def test_worker_found_from_its_checkpoint_engine(verl_results):
    assert verl_results["owning_worker"] and verl_results["owning_subclass_worker"]
    assert "checkpoint_engine" in verl_results["no_owner_error"]


def test_missing_or_wrong_engine_is_a_clear_error(verl_results):
    assert "ActorRolloutRefWorker.actor.engine" in verl_results["before_init_error"]
    assert "init_model" in verl_results["before_init_error"]
    assert "FSDPEngine" in verl_results["fsdp_error"] and "actor.strategy=megatron" in verl_results["fsdp_error"]


def test_buffers_released_before_save_and_restored_after(verl_results):
    assert verl_results["save_order"] == ["release", "save /ckpt step=7", "restore"]
    assert verl_results["class_untouched"] and verl_results["first_replaced"]
    assert verl_results["removed_restores_previous"]


def test_buffers_restored_even_when_the_save_fails(verl_results):
    assert verl_results["error_propagated"]
    assert verl_results["error_order"] == ["release", "save", "restore"]

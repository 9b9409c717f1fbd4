"""R28 with the real export: a rollout rank frozen (SIGSTOP) past `p2p_transfer_timeout` fails the write of every
trainer rank that sends to it; the real P2PCheckpointEngineManager re-pushes that target through the same ranks,
and the sync succeeds with every byte SGLang's loader holds from the checkpoint.

Those ranks are healthy senders (their errors name the target), and in these layouts no other rank can send their
part, so a re-push that left them out (main at 316189d) could not run at all:
- Megatron-Bridge TP1 x PP2, one trainer rank per pipeline stage (every one-GPU trainer is one rank of one stage);
  each rollout rank takes its layers from both ranks, so the frozen one fails both.
- Megatron-Bridge TP1 x DP2 with one rollout target: the two data-parallel copies split that target's tensors.
- FSDP2 `fully_shard` on two ranks: every rank writes a part of every target.

The frozen rollout rank thaws (SIGCONT) THAW_AFTER of a write timeout after the driver announces the re-push (its
"re-pushing" log line): a stall that outlives the first write's timeout and ends while the re-push runs, as a
rollout rank paused by its host for a few seconds does. The first push's write call is still blocked in Mooncake
when its deadline passes (Mooncake's own timeout fires a little later); the re-push's push waits for that call
before writing the same rollout rank, then writes it (blocked until the thaw, inside its own timeout). Before: the
target was refused at once for a call still in flight, and the failure policy's immediate re-syncs refused it
again within milliseconds until the run stopped.

Real: the gloo world, the exports, SourceSession, Mooncake tcp writes into receiver processes, the signals, Ray
actors, the manager and its lifecycle. Stand-ins, named as such: those of tests/test_manager_stalled_export.py
(the rollout's control plane FakeSGLang, verl's replicas, worker group and actor worker).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from test_manager_stalled_export import (  # noqa: F401 - the module fixtures, reused per layout
    RETRIED,
    World,
    model_dir,
    world,
)
from test_push_deadline import cluster  # noqa: F401 - the module's local Ray cluster (log_to_driver=False)

from verl_p2p.backend.failure_policy import SyncFailuresError
from verl_p2p.backend.metrics import PREFIX

pytestmark = pytest.mark.slow

LIFECYCLE_LOGGER = "verl_p2p.rollout.lifecycle"  # the sync's steps log there
MARGIN_S = 12.0  # the driver's re-push round (a new plan, a new go/no-go group, the export again) on a 2-core host
THAW_AFTER = 0.75  # of p2p_transfer_timeout, after the re-push began: inside the re-push's wait for the blocked call


class ThawAfterRepush(logging.Handler):
    """Thaws the frozen receiver `delay_s` after the driver logs that it re-pushes (the lifecycle's warning);
    notes when, relative to `t0`."""

    def __init__(self, receiver: Any, delay_s: float) -> None:
        super().__init__(logging.WARNING)
        self.receiver, self.delay_s = receiver, delay_s
        self.t0 = self.repush_at = self.thawed_at = None
        self.timer: threading.Timer | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.timer is None and record.getMessage().startswith("p2p: re-pushing"):
            self.repush_at = time.monotonic() - self.t0
            self.timer = threading.Timer(self.delay_s, self._thaw)
            self.timer.start()

    def _thaw(self) -> None:
        self.receiver.thaw()
        self.thawed_at = time.monotonic() - self.t0


@pytest.mark.parametrize(
    "world", ["megatron_one_rank_per_stage", "megatron_split_target", "fsdp"], indirect=True
)  # fmt: skip
def test_a_write_timeout_is_re_pushed_by_the_ranks_it_failed_for(world: World):  # noqa: F811 - the fixture
    ranks = tuple(range(world.setup.ranks))
    transfer_timeout_s = world.options["p2p_transfer_timeout"]
    report: dict[str, Any] = {"transfer_timeout_s": transfer_timeout_s, "sync1_s": round(world.exact_sync(), 2)}
    stages = [s.pp_stage for s in world.manager._sources]
    assert stages == ([0, 1] if world.setup.pp == 2 else [0, 0]), stages
    frozen = world.rollout.targets[0]
    plan = world.held(ranks)
    # the layout: every rank sends a part of the frozen target, so no other rank could re-push it
    assert all(frozen in p["targets"] for p in plan.values()), plan
    receiver = world.rollout.receivers[frozen]
    thaw = ThawAfterRepush(receiver, THAW_AFTER * transfer_timeout_s)
    logger = logging.getLogger(LIFECYCLE_LOGGER)
    logger.addHandler(thaw)

    def freeze() -> None:
        receiver.freeze()
        thaw.t0 = time.monotonic()

    try:
        metrics, seconds = world.sync(before=freeze)
    finally:
        logger.removeHandler(thaw)
        if thaw.timer is not None:
            thaw.timer.join()
        receiver.thaw()
    report.update(sync2_s=round(seconds, 2), repush_at_s=thaw.repush_at, thawed_at_s=thaw.thawed_at)
    assert isinstance(metrics, dict), f"the re-push did not recover the sync: {metrics}"
    assert thaw.repush_at is not None and thaw.repush_at > transfer_timeout_s, report  # the write timed out first
    assert metrics[RETRIED] == 1.0 and metrics[f"{PREFIX}failed_attempts"] == 0.0, metrics  # within the sync
    assert seconds < (1 + THAW_AFTER) * transfer_timeout_s + MARGIN_S, report
    repush = world.held(ranks)  # the re-push's plan: the same ranks wrote the frozen target again
    assert {r: p["targets"] for r, p in repush.items()} == dict.fromkeys(ranks, (frozen,)), repush
    assert world.rollout.wrong(f"sync{world.step}") == {}  # every target: SGLang's load of the checkpoint
    assert all(s.weight_version == str(world.step) and not s.paused for s in world.servers)
    report["sync3_s"] = round(world.exact_sync(), 2)  # and the next sync, whole
    print(f"{world.setup.kind} tp{world.setup.tp} pp{world.setup.pp}: {report}")


@pytest.mark.parametrize("world", ["megatron_one_rank_per_stage"], indirect=True)
def test_a_rollout_rank_that_stays_frozen_stops_one_step_offs_run_after_the_budget(world: World):  # noqa: F811
    """The stall does not end: verl's one_step_off `_fit_update_weights` (test_sync_failures' bare trainer) raises
    SyncFailuresError once `p2p_max_consecutive_failures` syncs failed in a row, each push and re-push costing
    about one write timeout (a write timing out, or a wait for the call blocked before it): about
    T x (p2p_push_retries + 1) x p2p_max_consecutive_failures in all (docs/failures.md). The frozen replica stays
    paused at its old version, never resumed; thawed, the next sync writes it whole."""
    from test_sync_failures import fit_update_weights, one_step_off

    transfer_timeout_s = world.options["p2p_transfer_timeout"]
    budget_s = transfer_timeout_s * (world.options["p2p_push_retries"] + 1) * 3  # the option's default: 3
    world.exact_sync()
    frozen = world.rollout.targets[0]
    receiver = world.rollout.receivers[frozen]
    world.rollout.fill()
    receiver.freeze()
    trainer = one_step_off(world.manager)
    t0 = time.monotonic()
    try:
        with pytest.raises(SyncFailuresError) as info:
            fit_update_weights(trainer, world.step + 1)
        seconds = time.monotonic() - t0
        world.step += 1
        error, text = info.value, str(info.value)
        print(f"frozen for good: the run stopped after {seconds:.2f} s (budget {budget_s:g} s)")
        assert "3 weight syncs failed in a row (p2p_max_consecutive_failures=3): the run stops" in text, text
        assert f"engine {frozen.engine} rank {frozen.rank}" in text and "timed out" in text, text
        assert budget_s - transfer_timeout_s < seconds < budget_s + MARGIN_S, f"{seconds:.1f} s, budget {budget_s} s"
        assert error.stale_engines == [frozen.engine]
        world.assert_paused([frozen.engine])  # never resumed with unknown bytes
    finally:
        receiver.thaw()
    world.exact_sync()  # thawed: every byte, every replica resumed

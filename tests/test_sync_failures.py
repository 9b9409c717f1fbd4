"""What the training job sees when a weight sync fails (issue 40 item 7; verl_p2p/backend/failure_policy.py).

Driven through verl 0.9.1's own one_step_off `_fit_update_weights` (SeparateRayPPOTrainer's, called from
inside the running loop as `_fit_generate` calls it) on a bare trainer object holding only what it reads. v1
v1 separate_async: verl's own `PPOTrainerSeparateAsync.on_step_end` on a bare trainer object (hybrid switching
off); its module imports `transfer_queue`, which this venv cannot install, so a stand-in module holding the one name
the import reads (`KVBatchMeta`, a type annotation; `on_step_end` never uses it) is put in `sys.modules` first.
fully_async: verl's own `FullyAsyncTrainer._fit_update_weights` (the class under its Ray actor wrapper) on a bare
trainer object, with a Ray actor standing in for its rollouter (the three calls the method makes of it).

Real: the manager, the sync lifecycle, 2 trainer ranks as Ray actors (real P2PCheckpointEngine each).
Stand-ins: the trainer ranks' sessions (tests/support/flaky_ranks.py), the SGLang servers
(tests/support/fake_sglang.py), verl's worker group and replicas (deadline_ranks, test_manager).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from types import SimpleNamespace

import pytest
import ray
from omegaconf import OmegaConf
from support import flaky_ranks
from support.deadline_ranks import RayActorGroupStandIn, start_rank
from support.fake_sglang import FakeSGLang
from test_manager import ReplicaStandIn
from test_push_deadline import cluster  # noqa: F401 - the local Ray cluster fixture
from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer
from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
from verl.workers.config import CheckpointEngineConfig

from verl_p2p.backend.manager import P2PCheckpointEngineManager
from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PConfigError
from verl_p2p.rollout.launch import MEMORY_SAVER, SEED_FLAG
from verl_p2p.rollout.lifecycle import SyncError

pytestmark = pytest.mark.slow

WORLD = 2
OPTIONS = {"p2p_push_retries": 0, "http_timeout": 10, "p2p_transfer_timeout": 5.0, "p2p_push_deadline_s": 30.0}
SYNC = ["pause_generation", "begin_weight_update", "update_weight_version", "end_weight_update", "flush_cache"]
PARKED = ["pause_generation", "begin_weight_update", "end_weight_update"]  # stale: never continue_generation
M = "checkpoint_engine/p2p/"


@pytest.fixture(scope="module")
def ranks(cluster):  # noqa: F811 - the fixture imported above
    """The trainer-rank actors, started once for the module: each test gives them a new engine (`reset`)."""
    actors = [start_rank(flaky_ranks.FlakyRankActor, r, WORLD, OPTIONS) for r in range(WORLD)]
    ray.get([actor.ready.remote() for actor in actors], timeout=300)
    yield actors
    for actor in actors:
        ray.kill(actor)


@pytest.fixture
def world(ranks, request):
    """(options, {rank: failing push numbers}) -> the manager, its servers and the trainer-rank actors."""
    extra, fail_on = request.param
    options = {**OPTIONS, **extra}
    servers = [FakeSGLang(tp_size=2, server_args={SEED_FLAG: True, MEMORY_SAVER: False}) for _ in range(2)]
    urls = {engine: server.url for engine, server in enumerate(servers)}
    ray.get([actor.reset.remote(options, fail_on.get(r, ()), urls) for r, actor in enumerate(ranks)], timeout=300)
    config = CheckpointEngineConfig(backend="p2p", engine_kwargs={"p2p": options})
    group = RayActorGroupStandIn(ranks)
    manager = P2PCheckpointEngineManager(config, group, [ReplicaStandIn(i, s) for i, s in enumerate(servers)])
    yield manager, servers, ranks
    manager.close()
    for server in servers:
        server.stop()


def one_step_off(manager) -> OneStepOffRayTrainer:
    """verl's one_step_off trainer object, bare: what its `_fit_update_weights` reads, nothing else."""
    trainer = object.__new__(OneStepOffRayTrainer)
    trainer.config = OmegaConf.create({"trainer": {"critic_warmup": 0}})
    trainer.checkpoint_manager = manager
    trainer.timing_raw, trainer.metrics, trainer.global_steps = {}, {}, 0
    return trainer


def fit_update_weights(trainer: OneStepOffRayTrainer, step: int) -> dict:
    """One step's sync as `_fit_generate` runs it: a plain call from inside the trainer's running event loop."""
    trainer.global_steps, trainer.metrics = step, {}

    async def fit_generate() -> None:
        trainer._fit_update_weights()

    asyncio.run(fit_generate())
    return trainer.metrics


def separate_async_class():
    """verl's v1 separate_async trainer class, imported with a stand-in `transfer_queue` module when the real one
    is absent (the module's import reads only `KVBatchMeta` from it)."""
    stand_in = "transfer_queue" not in sys.modules and importlib.util.find_spec("transfer_queue") is None
    if stand_in:
        sys.modules["transfer_queue"] = SimpleNamespace(KVBatchMeta=type("KVBatchMetaStandIn", (), {}))
    try:
        from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
    finally:
        if stand_in:  # no other test of this process sees it
            del sys.modules["transfer_queue"]
    return PPOTrainerSeparateAsync


def step_end(manager, step: int) -> dict:
    """One step's end in verl's v1 separate_async loop: its own `on_step_end` (hybrid switching off) on a bare
    trainer object; the step's sync metrics are what it keeps for the step's log."""
    cls = separate_async_class()
    trainer = object.__new__(cls)
    trainer.prev_step_profile = False
    trainer.hybrid_rollout_config = SimpleNamespace(enable_switch=False)
    trainer.standalone_checkpoint_manager, trainer.global_steps, trainer.timing_raw = manager, step, {}
    cls.on_step_end(trainer)
    assert "update_weights" in trainer.timing_raw  # verl's own method ran the sync under its timer
    return trainer._pending_sync_metrics


@ray.remote(num_cpus=0)
class RollouterStandIn:
    """What fully_async's `_fit_update_weights` asks of its rollouter actor (counts, then the staleness reset)."""

    def get_total_produced_samples(self) -> int:
        return 0

    def get_completed_steps(self) -> int:
        return 0

    def reset_staleness(self) -> dict:
        return {}


class LoggerStandIn:
    def log(self, data, step) -> None:
        pass


def fully_async(manager, rollouter) -> FullyAsyncTrainer:
    """verl's fully_async trainer object, bare (the class under its Ray actor wrapper): what its
    `_fit_update_weights` reads, nothing else; no dynamic schedule, no profiler steps."""
    cls = FullyAsyncTrainer.__ray_metadata__.modified_class
    trainer = object.__new__(cls)
    trainer.config = OmegaConf.create({"global_profiler": {"steps": None}})
    trainer.checkpoint_manager, trainer.rollouter, trainer.logger = manager, rollouter, LoggerStandIn()
    trainer.dynamic_schedule_ctx = SimpleNamespace(step_required_samples=1)
    trainer.staleness_threshold, trainer.dynamic_schedule_enabled, trainer.only_hybrid = 0, False, False
    trainer.timing_raw, trainer.local_trigger_step, trainer.current_param_version = {}, 1, 0
    trainer._step_wait_times, trainer._step_wait_samples = [], []
    return trainer


def fully_async_update_weights(trainer, step: int) -> None:
    """One sync as fully_async's loop awaits it: the trainer's own method on the current parameter version."""
    trainer.current_param_version, trainer.local_trigger_step = step, 1
    asyncio.run(type(trainer)._fit_update_weights(trainer))


def calls_since(server: FakeSGLang, start: int) -> list[str]:
    """The lifecycle calls from `start` on, less the pushes (which the weights-check tests count)."""
    return [c for c in server.lifecycle_calls()[start:] if c != "push"]


@pytest.mark.parametrize("world", [({}, {1: (2,)})], indirect=True)
def test_one_step_off_a_sync_that_left_a_replica_paused_is_synced_again_in_the_same_call(world):
    """Rank 1's push fails once (the step-1 sync): its engine is left paused (bytes unknown), which would stall
    one_step_off's next batch, so the manager syncs again at once; the step goes on, the paused engine is written
    and resumed, and the step's metrics say a sync failed."""
    manager, servers, actors = world
    trainer = one_step_off(manager)
    fit_update_weights(trainer, 0)
    before = [len(s.lifecycle_calls()) for s in servers]
    engines = {t.engine for t in ray.get(actors[1].written.remote())[0]}

    metrics = fit_update_weights(trainer, 1)

    assert metrics[M + "failed_attempts"] == 1.0, metrics
    assert metrics[M + "sync_failed"] == 0.0 and metrics[M + "consecutive_failures"] == 0.0
    assert ray.get(actors[1].pushes.remote()) == 3  # step 0, the failed one, the re-sync
    for engine, server in enumerate(servers):
        assert server.weight_version == "1" and not server.paused and server.violations == []
        calls = calls_since(server, before[engine])
        if engine in engines:  # parked by the failed sync (no continue_generation), then written and resumed
            assert calls == PARKED + SYNC + ["continue_generation"], calls
        else:
            assert calls == 2 * (SYNC + ["continue_generation"]), calls
    assert fit_update_weights(trainer, 2)[M + "failed_attempts"] == 0.0
    assert all(s.weight_version == "2" and not s.paused for s in servers)


@pytest.mark.parametrize("world", [({}, {})], indirect=True)
def test_separate_async_a_sync_that_wrote_nothing_is_retried_by_the_next_step(world):
    """Engine 0's pause fails at step 1: nothing was written, every replica resumed holding step 0's weights, so
    the run goes on (verl's v1 loop logs sync_failed=1) and step 2's sync is the retry."""
    manager, servers, _ = world
    step_end(manager, 0)
    servers[0].fail("pause_generation", 500, {"error": {"message": "injected: pause failed"}}, times=1)

    metrics = step_end(manager, 1)

    assert metrics[M + "sync_failed"] == 1.0 and metrics[M + "consecutive_failures"] == 1.0, metrics
    assert all(s.weight_version == "0" and not s.paused and s.violations == [] for s in servers)
    metrics = step_end(manager, 2)
    assert metrics[M + "sync_failed"] == 0.0 and metrics[M + "consecutive_failures"] == 0.0, metrics
    assert all(s.weight_version == "2" and not s.paused and s.violations == [] for s in servers)


@pytest.mark.parametrize("world", [({"p2p_max_consecutive_failures": 2}, {})], indirect=True)
def test_failures_deferred_step_after_step_stop_the_run_at_the_limit(world):
    """Every pause fails from step 1 on: step 1 is ridden out, step 2's is the second failure in a row and, with
    p2p_max_consecutive_failures=2, stops the run naming the count, the option and the last failure."""
    manager, servers, _ = world
    step_end(manager, 0)
    servers[1].fail("pause_generation", 500, {"error": {"message": "injected: pause failed"}}, times=None)
    assert step_end(manager, 1)[M + "sync_failed"] == 1.0
    with pytest.raises(SyncError) as info:
        step_end(manager, 2)
    text = str(info.value)
    assert "2 weight syncs failed in a row (p2p_max_consecutive_failures=2)" in text, text
    assert "injected: pause failed" in text and "p2p_max_consecutive_failures higher" in text, text
    assert all(s.weight_version == "0" for s in servers)


@pytest.mark.parametrize("world", [({}, {1: (2, 3, 4, 5)})], indirect=True)
def test_fully_async_a_sync_that_keeps_failing_stops_the_run_and_never_resumes_the_stale_replica(world):
    """Rank 1's push fails every time from step 1 on: its engine stays paused through all three syncs of the
    call (never continue_generation), and the third failure stops the run with the named error."""
    manager, servers, actors = world
    trainer = fully_async(manager, RollouterStandIn.remote())

    fully_async_update_weights(trainer, 0)
    assert "timing_s/param_sync" in trainer.timing_raw  # verl's own method ran the sync under its timer
    engines = {t.engine for t in ray.get(actors[1].written.remote())[0]}
    before = [len(s.lifecycle_calls()) for s in servers]
    with pytest.raises(SyncError) as info:
        fully_async_update_weights(trainer, 1)
    error, text = info.value, str(info.value)
    assert "3 weight syncs failed in a row (p2p_max_consecutive_failures=3): the run stops" in text, text
    assert "failed at push" in text and "trainer rank 1" in text and "Replicas still paused" in text, text
    assert (error.count, error.limit) == (3, 3) and set(error.stale_engines) == engines
    assert ray.get(actors[1].pushes.remote()) == 4  # step 0 plus three failed syncs
    for engine, server in enumerate(servers):
        calls = calls_since(server, before[engine])
        if engine in engines:
            assert calls == 3 * PARKED and server.paused and server.weight_version == "0", calls
        else:
            assert server.weight_version == "1" and not server.paused, calls
        assert server.violations == []


CHECK = {"check_weight_update_equal": True}
MISMATCH = "model.layers.0.mlp.weight: values differ from the snapshot (injected)"


@pytest.mark.parametrize("world", [(CHECK, {})], indirect=True)
def test_one_step_off_a_weights_check_failing_once_is_checked_again_in_the_same_call(world):
    """check_weight_update_equal: engine 1's first compare fails (a byte the sync missed, as the rollout's
    weights_checker reports it). The engine stays paused (never serves unchecked weights), is re-armed, written
    and compared again inside the same `update_weights` call; the second compare passes and the step goes on."""
    manager, servers, _ = world
    servers[1].compare_error, servers[1].compare_error_times = MISMATCH, 1
    trainer = one_step_off(manager)

    metrics = fit_update_weights(trainer, 0)

    assert metrics[M + "failed_attempts"] == 1.0 and metrics[M + "sync_failed"] == 0.0, metrics
    assert all(s.weight_version == "0" and not s.paused and s.violations == [] for s in servers)
    checks = [c for c in servers[1].calls if c == "weights_checker"]
    assert len(checks) == 6, servers[1].calls  # snapshot, reset, compare (failed); again, passed
    calls = servers[1].lifecycle_calls()
    assert calls.count("continue_generation") == 1 and calls[-1] == "continue_generation", calls
    assert calls.index("continue_generation") > max(i for i, c in enumerate(calls) if c == "weights_checker")


@pytest.mark.parametrize("world", [(CHECK, {})], indirect=True)
def test_one_step_off_a_weights_check_that_keeps_failing_stops_the_run_with_the_replica_paused(world):
    """Every compare of engine 1 fails: the call re-checks it until p2p_max_consecutive_failures, then the run
    stops naming the mismatch and the paused replica; engine 1 never resumed, engine 0 checked and serving."""
    manager, servers, _ = world
    servers[1].compare_error = MISMATCH
    trainer = one_step_off(manager)

    with pytest.raises(SyncError) as info:
        fit_update_weights(trainer, 0)

    text = str(info.value)
    assert "3 weight syncs failed in a row (p2p_max_consecutive_failures=3)" in text, text
    assert MISMATCH in text and "Replicas still paused" in text, text
    assert info.value.stale_engines == [1]
    assert servers[1].paused and "continue_generation" not in servers[1].lifecycle_calls()
    assert not servers[0].paused and servers[0].weight_version == "0"
    assert all(s.violations == [] for s in servers)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3"])
def test_p2p_max_consecutive_failures_is_validated(value):
    assert P2PConfig().p2p_max_consecutive_failures == 3
    with pytest.raises(P2PConfigError, match=r"p2p_max_consecutive_failures=.* \(a positive integer"):
        P2PConfig.from_mapping({"p2p_max_consecutive_failures": value})

"""verl's real classes end to end on a local Ray cluster (CPU): trainer actor workers holding a Megatron model built
through Megatron-Bridge sync their weights into two loopback SGLang rollout engines over real Mooncake (tcp),
driven first by verl's stock CheckpointEngineManager (the engine-only path), then by P2PCheckpointEngineManager.

Model: tiny Qwen3-MoE, float32, id-encoded (every element a distinct integer). Trainer: 2 ranks, Megatron TP2/EP2.
Rollout: engine 0 TP2/EP2, engine 1 TP2/EP1 (two ranks each, SGLang's own model classes and loader).

Expected bytes: each loopback rank loaded the checkpoint through SGLang's own distributed path at start-up; its
dump then (`initial`) is the independent witness. The first sync runs after the loopback's weights_checker
`reset_tensors` (armed by the backend's `check_weight_update_equal`), so it must restore every byte. Later steps
scale the trainer's Megatron parameters by 2 (exact in float32: only the exponent changes); SGLang's loader only
copies, slices and concatenates checkpoint tensors, so the rank bytes of the scaled checkpoint are the witness's
bytes scaled by the same factor, compared bit for bit.

Steps: stock manager 1 (engine 0 only, weights checker armed) -> 2 (engine 1 added: only it publishes rank info,
the trainer is re-planned) -> 3 (scaled weights, same replicas: same plan and data plane); P2P manager 4 (engine 0
only) -> 5 (scaled, no reconnect, no trainer round but the push) -> 6 (engine 1 added: only it is reconnected).

Under the installed SGLang 0.5.12 (verl 0.9.1's pin) the engines have no weight-update sessions (begin answers 404
once per client, no end). To see begin/end too, run this module under SGLang 0.5.23:
`PYTHONPATH=.venv/sglang-0.5.23 .venv/bin/pytest tests/test_verl_e2e.py` (the trainer and the loopback ranks then
both use 0.5.23; the replica reproduces only its own release's bytes).

Stand-ins (see tests/support/verl_workers.py for why each): verl's ActorRolloutRefWorker (CPU Megatron model in
verl's MegatronEngine class), SGLang ServerAdapter, SGLangHttpServer and SGLangReplica (over loopback engines).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import requests
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(540)]

ROOT = Path(__file__).resolve().parents[1]
SPECS = ({"tp": 2, "ep": 2}, {"tp": 2, "ep": 1})
TRAINER = {"tp": 2, "ep": 2, "etp": 1}
P2P_OPTIONS = {
    "protocol": "tcp",
    "hostname": "127.0.0.1",
    "bucket_size_mb": 1,
    "http_timeout": 60,
    "p2p_transfer_timeout": 60,
}
LIFECYCLE = {
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weight_version",
    "/flush_cache",
    "/weights_checker",
}
ENV = {  # RAY_AUTH_MODE: one value for the whole suite, set by conftest.py
    "MC_LOG_LEVEL": "ERROR",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "0",
}


def checkpoint_engine(backend: str = "p2p", **p2p) -> dict:
    """verl's checkpoint_engine section; the options go under engine_kwargs.<backend> (verl passes that entry)."""
    return {
        "backend": backend,
        "update_weights_bucket_megabytes": 64,
        "custom_backend_module": "verl_p2p",
        "engine_kwargs": {backend: {**P2P_OPTIONS, **p2p}},
    }


class World:
    """Everything the module shares: loopback engines, the Ray cluster, trainer workers, verl replicas."""

    def __init__(self) -> None:
        self.engines: list = []
        self.trainer = None
        self.replicas: list = []
        self.initial: list[list[dict[str, torch.Tensor]]] = []  # [engine][rank] -> SGLang's own load
        self.factor = 1.0  # trainer weights = factor x checkpoint
        # The engines imitate the installed SGLang (the trainer's replica reproduces only its own release's
        # bytes). 0.5.12, verl 0.9.1's pin, predates weight-update sessions: begin answers 404 once per client and
        # the backend carries on without them. Under 0.5.21+ (e.g. PYTHONPATH=.venv/sglang-0.5.23) begin/end run.
        self.sessions = False

    def dumps(self, engine: int) -> list[dict[str, torch.Tensor]]:
        e = self.engines[engine]
        return [e.dump(rank) for rank in range(e.spec.tp)]

    def mark(self) -> list[int]:
        return [len(e.events()) for e in self.engines]

    def events(self, engine: int, since: list[int]) -> list[dict]:
        return self.engines[engine].events(since[engine])

    def server_state(self, engine: int) -> dict:
        import ray

        return ray.get(self.replicas[engine].servers[0].state.remote())

    def trainer_state(self) -> list[dict]:
        return self.trainer.p2p_state()

    def scale(self, factor: float) -> None:
        self.trainer.scale_weights(factor)
        self.factor *= factor


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import ray
    from support.verl_workers import (
        LoopbackReplica,
        launch_replica,
        rollout_config,
        trainer_config,
        trainer_group,
    )
    from verl.workers.config import HFModelConfig

    from verl_p2p.backend import topology
    from verl_p2p.loopback.engine import EngineSpec, LoopbackEngine
    from verl_p2p.sandbox.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("verl_e2e") / "ckpt", "qwen3_moe")
    w = World()
    saved_env = {k: os.environ.get(k) for k in [*ENV, "PYTHONPATH"]}
    os.environ.update(ENV)
    # Ray's workers inherit this process's environment: the repo and tests/ (the stand-ins' module) importable
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    topology.DRIVER_CACHE.reset()
    t0 = time.monotonic()
    try:
        w.engines = [LoopbackEngine(EngineSpec(dtype="float32", **spec), str(path)).start() for spec in SPECS]
        ray.init(
            address="local",  # a new cluster of its own, never one another process started on this host
            num_cpus=6,  # logical: one per trainer and rollout worker (CPU bundles); the host has 2 cores
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            # every actor here has its own runtime env (verl sets per-worker env vars): prestarted idle
            # workers would never be used, only compete for the two cores
            _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
        )
        phases = {"ray": time.monotonic() - t0}
        w.trainer = trainer_group(trainer_config(path, checkpoint_engine(check_weight_update_equal=True), **TRAINER), 2)
        phases["trainer"] = time.monotonic() - t0
        for engine in w.engines:
            engine.wait_ready()
        w.sessions = all(e.features.weight_update_session for e in w.engines)
        phases["loopback"] = time.monotonic() - t0
        model_config = HFModelConfig(path=str(path), load_tokenizer=False)
        ce = checkpoint_engine(check_weight_update_equal=True)
        replicas = [
            LoopbackReplica(
                i,
                rollout_config(ce, tp=e.spec.tp, bootstrap_port=e.bootstrap_port),
                model_config,
                server_url=e.url,
            )
            for i, e in enumerate(w.engines)
        ]

        async def launch():
            return await asyncio.gather(*(launch_replica(r) for r in replicas))

        w.replicas = asyncio.run(launch())
        phases["replicas"] = time.monotonic() - t0
        w.initial = [w.dumps(i) for i in range(len(w.engines))]
        phases["dumps"] = time.monotonic() - t0
        print(
            f"[verl_e2e] SGLang {w.engines[0].features.version} (sessions: {w.sessions}); set-up done at (s): "
            + ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
        )
        yield w
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for engine in w.engines:
            engine.stop()
        topology.DRIVER_CACHE.reset()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ---- checks --------------------------------------------------------------------------------------------------


def assert_weights(world: World, engine: int, factor: float) -> None:
    """Every parameter of every rank of `engine` is bit-exactly `factor` x SGLang's own load of the checkpoint."""
    for rank, (got, witness) in enumerate(zip(world.dumps(engine), world.initial[engine], strict=True)):
        assert set(got) == set(witness), f"engine {engine} rank {rank}: parameter names differ"
        for name, want in witness.items():
            expected = want * factor if factor != 1.0 else want
            have = got[name]
            assert have.dtype == expected.dtype and have.shape == expected.shape, (engine, rank, name)
            same = torch.equal(have.view(-1).view(torch.uint8), expected.contiguous().view(-1).view(torch.uint8))
            assert same, (
                f"engine {engine} rank {rank} {name}: not {factor} x the checkpoint's bytes "
                f"(max |diff| {(have - expected).abs().max().item()})"
            )


def lifecycle(events: list[dict]) -> list[str]:
    """The lifecycle calls of an event log slice as 'path[detail]'; any answer but 200 is appended as '(status)'."""
    out = []
    for e in events:
        if e["path"] not in LIFECYCLE:
            continue
        body = e["body"] or {}
        detail = body.get("action") or body.get("mode") or body.get("new_version") or ",".join(body.get("tags") or [])
        label = f"{e['path'][1:]}[{detail}]" if detail else e["path"][1:]
        out.append(label if e["status"] == 200 else f"{label}({e['status']})")
    return out


def expected_sync(step: int, sessions: bool, first: bool, *, kv: bool, check: bool, flush: bool) -> list[str]:
    """The calls one sync makes on one engine. Without sessions (SGLang < 0.5.21) a client's first begin answers
    404 and no end follows; later syncs of that client skip both. `flush`: verl's own ServerAdapter flush (the
    stock path), which may run before the writes land; p2p's own flush always follows the last write and the end."""
    calls = ["pause_generation[abort]"]
    calls += ["release_memory_occupation[kv_cache]"] if kv else []
    calls += ["weights_checker[snapshot]", "weights_checker[reset_tensors]"] if check else []
    calls += ["begin_weight_update"] if sessions else (["begin_weight_update(404)"] if first else [])
    calls += ["flush_cache"] if flush else []  # verl's ServerAdapter, after the (empty) stream, before finalize
    calls += [f"update_weight_version[{step}]"]
    calls += ["end_weight_update"] if sessions else []
    calls += ["weights_checker[compare]"] if check else []  # bitwise: every parameter and buffer restored
    calls += ["flush_cache"]  # p2p's: after the last write and the end, before generation resumes
    calls += ["resume_memory_occupation[kv_cache]", "flush_cache"] if kv else []
    return calls + ["continue_generation"]


def count(events: list[dict], path: str) -> int:
    return sum(e["path"] == path for e in events)


def total_bytes(world: World, engines) -> int:
    return sum(t.numel() * t.element_size() for e in engines for rank in world.initial[e] for t in rank.values())


# ---- verl's stock manager: the engine-only path ---------------------------------------------------------------


def test_stock_manager_syncs_adds_a_replica_and_reuses_the_connection(world):
    import ray
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.workers.config import CheckpointEngineConfig

    manager = CheckpointEngineManager(
        config=CheckpointEngineConfig(**checkpoint_engine(check_weight_update_equal=True)),
        actor_wg=world.trainer,
        replicas=[world.replicas[0]],
    )
    assert manager.backend_cls.__name__ == "P2PCheckpointEngine"  # resolved through verl's registry

    def sync(step: int, engine: int, first: bool) -> list[str]:
        # a leader arms the weights checker on its own first sync (snapshot + reset, compare after)
        return expected_sync(step, world.sessions, first, kv=True, check=first, flush=True)

    # step 1: engine 0 only; its ranks were reset to random values first, so every byte must be restored
    since = world.mark()
    metrics = manager.update_weights(global_steps=1)
    assert lifecycle(world.events(0, since)) == sync(1, 0, True)
    assert world.events(1, since) == []  # not in the manager: not touched
    state = world.events(0, since)[-1]["state"]
    assert state["weight_version"] == "1" and not state["paused"] and not state["session_open"]
    assert not state["released_tags"]
    assert world.server_state(0)["global_steps"] == 1
    assert_weights(world, 0, 1.0)
    # one key set for the sync; every byte of every target written exactly once
    assert all(k.startswith("checkpoint_engine/p2p/") for k in metrics), sorted(metrics)
    assert metrics["checkpoint_engine/p2p/bytes"] == total_bytes(world, [0])
    assert metrics["checkpoint_engine/p2p/sources"] == 2.0
    first = world.trainer_state()
    assert {s["role"] for s in first} == {"trainer_source"}
    assert {s["export_mode"] for s in first} == {"pp_local"}
    assert sorted(t for s in first for t in s["targets"]) == [(0, 0), (0, 1)]
    reads = count(world.events(0, [0, 0]), "/server_info")

    # step 2: engine 1 added -> only its leader publishes rank info; the trainer gets a new plan over both
    manager.add_replicas([world.replicas[1]])
    since = world.mark()
    metrics = manager.update_weights(global_steps=2)
    assert lifecycle(world.events(0, since)) == sync(2, 0, False)
    assert lifecycle(world.events(1, since)) == sync(2, 1, True)
    assert count(world.events(0, [0, 0]), "/server_info") == reads  # engine 0 only sent its digest
    assert count(world.events(1, since), "/server_info") >= 1
    for e in range(2):
        assert world.server_state(e)["global_steps"] == 2
        assert_weights(world, e, 1.0)
    assert metrics["checkpoint_engine/p2p/bytes"] == total_bytes(world, range(2))
    before = world.trainer_state()
    assert sorted(t for s in before for t in s["targets"]) == [(e, r) for e in range(2) for r in range(2)]
    for old, new in zip(first, before, strict=True):
        assert new["generation"] == old["generation"] + 1
        assert (new["session_id"], new["transport_id"]) == (old["session_id"], old["transport_id"])
    # nothing travelled through the rollout's CheckpointEngineWorkers: the streams they handed on were empty
    workers = [w for r in world.replicas for w in r.workers]
    received = ray.get([w.__ray_call__.remote(lambda self: list(self.server_adapter.received)) for w in workers])
    assert received == [[] for _ in workers]

    # step 3: new trainer weights, same replicas -> same plan, same data plane, no rank info re-read
    reads = [count(world.events(e, [0, 0]), "/server_info") for e in range(2)]
    world.scale(2.0)
    since = world.mark()
    manager.update_weights(global_steps=3)
    for e in range(2):
        assert lifecycle(world.events(e, since)) == sync(3, e, False), f"engine {e}"
        assert count(world.events(e, [0, 0]), "/server_info") == reads[e]
        assert count(world.events(e, since), "/remote_instance_transfer_engine_info") == 0
        assert_weights(world, e, world.factor)
    after = world.trainer_state()
    for old, new in zip(before, after, strict=True):
        for key in ("generation", "assignment_id", "session_id", "transport_id", "transport_session", "replica_ids"):
            assert new[key] == old[key], f"trainer rank reconnected: {key} changed"


# ---- P2PCheckpointEngineManager: the driver-side lifecycle -----------------------------------------------------


def test_p2p_manager_syncs_reuses_and_adds_a_replica(world):
    from verl.workers.config import CheckpointEngineConfig

    from verl_p2p.backend.manager import P2PCheckpointEngineManager

    manager = P2PCheckpointEngineManager(
        config=CheckpointEngineConfig(**checkpoint_engine("verl_p2p")),  # the unambiguous name, through verl's workers
        actor_wg=world.trainer,
        replicas=[world.replicas[0]],
    )

    def sync(step: int, engine: int, first: bool) -> list[str]:
        return expected_sync(step, world.sessions, first, kv=False, check=False, flush=False)

    try:
        left_alone = world.dumps(1)
        # step 4: engine 0 only (first connect of this manager)
        world.scale(2.0)
        since = world.mark()
        metrics = manager.update_weights(global_steps=4)
        assert lifecycle(world.events(0, since)) == sync(4, 0, True)
        assert world.events(1, since) == []  # not in the manager: not touched
        assert metrics["checkpoint_engine/p2p/reconnected"] == 1.0
        assert metrics["checkpoint_engine/p2p/bytes"] == total_bytes(world, [0])
        assert_weights(world, 0, world.factor)
        assert all(torch.equal(a[n], b[n]) for a, b in zip(world.dumps(1), left_alone, strict=True) for n in a)
        assert world.server_state(0)["global_steps"] == 4
        rounds, trainer_before = manager.trainer_rounds, world.trainer_state()

        # step 5: same replica set -> no reconnect, no Ray round to the trainer besides the push
        world.scale(2.0)
        since = world.mark()
        metrics = manager.update_weights(global_steps=5)
        assert lifecycle(world.events(0, since)) == sync(5, 0, False)
        assert count(world.events(0, since), "/server_info") == 0
        assert metrics["checkpoint_engine/p2p/reconnected"] == 0.0
        assert manager.trainer_rounds == rounds
        assert [s["assignment_id"] for s in world.trainer_state()] == [s["assignment_id"] for s in trainer_before]
        assert_weights(world, 0, world.factor)

        # step 6: add engine 1 -> only it is (re)connected; one re-plan round, no prepare round
        manager.add_replicas([world.replicas[1]])
        world.scale(2.0)
        since = world.mark()
        metrics = manager.update_weights(global_steps=6)
        for e in range(2):
            assert lifecycle(world.events(e, since)) == sync(6, e, e == 1), f"engine {e}"
            assert_weights(world, e, world.factor)
            assert world.server_state(e)["global_steps"] == 6
        assert count(world.events(0, since), "/server_info") == 0  # engine 0's cached connection kept
        assert count(world.events(1, since), "/server_info") >= 1
        assert manager._lifecycle._connection.changed_engines == frozenset({1})
        assert metrics["checkpoint_engine/p2p/reconnected"] == 1.0
        assert metrics["checkpoint_engine/p2p/bytes"] == total_bytes(world, range(2))
        assert manager.trainer_rounds == rounds + 1
        trainer_after = world.trainer_state()
        assert sorted(t for s in trainer_after for t in s["targets"]) == [(e, r) for e in range(2) for r in range(2)]
        for before, after in zip(trainer_before, trainer_after, strict=True):
            assert after["transport_id"] == before["transport_id"]  # the Mooncake endpoint and buffers persist
            assert after["session_id"] == before["session_id"]
    finally:
        manager.close()


def test_loopback_answers_were_all_successful(world):
    """No control-plane call was refused (out of order) by the loopback engines, except begin on engines
    imitating a release without sessions; no engine recorded a violation (a stale prefix cache served, generation
    resumed inside a session or with its KV cache released) on either manager path."""
    for e in range(2):
        assert world.engines[e].violations() == []
        refused = [
            (x["path"], x["status"], x["message"])
            for x in world.events(e, [0, 0])
            if x["status"] >= 400 and not (x["path"] == "/begin_weight_update" and not world.sessions)
        ]
        assert refused == [], refused
        health = requests.get(f"{world.engines[e].url}/health", timeout=10)
        assert health.status_code == 200

"""verl's trainer and rollout workers on a CPU-only Ray cluster, for the end-to-end test (tests/test_verl_e2e.py).

Real: verl's Worker base, `register`/dispatch decorators, RayWorkerGroup/RayResourcePool, RolloutReplica (base),
CheckpointEngineWorker (the rollout side's checkpoint-engine worker, built by RolloutReplica.init_colocated),
HFModelConfig, the checkpoint-engine registry, Megatron-Bridge and megatron-core (the model, its parallel groups,
the HF load and export), Ray actors.

Stand-ins, each because verl's real class cannot run on a host without CUDA:

- `ActorWorkerStandIn` for verl's `ActorRolloutRefWorker` (role "actor", Megatron strategy): verl's worker builds
  its MegatronEngine on CUDA. It holds a real Megatron model built through Megatron-Bridge on CPU, wrapped in an
  instance of verl's real `MegatronEngine` class (made without its CUDA `__init__`), at the attribute path verl
  uses (`worker.actor.engine`), builds the checkpoint engine and runs `update_weights` exactly as verl does.
- `ServerAdapterStandIn` for verl's SGLang `ServerAdapter` (imports SGLang's GPU kernels): what the rollout's
  CheckpointEngineWorker reads of it and what its `update_weights` does after receiving weights.
- `SGLangServerStandIn` for verl's `SGLangHttpServer` (runs SGLang's server in-process, needs GPUs): the named
  Ray actor verl's replica and adapter talk to; its control calls go to a loopback engine over HTTP, the way
  SGLang's tokenizer manager would act on them.
- `LoopbackReplica` for verl's `SGLangReplica` (its module imports SGLang's server): verl's RolloutReplica base
  with SGLangReplica's overrides (abort/resume on the first server only) and CPU workers.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import ray
import requests
import torch
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.workers.config import CheckpointEngineConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from verl_p2p.e2e.verl_actor import MegatronActorWorker, actor_config

# ------------------------------------------------------------------------------------------------ trainer side


class ActorWorkerStandIn(MegatronActorWorker):
    """Stand-in for verl's ActorRolloutRefWorker (role "actor", actor.strategy=megatron) on a CPU host: the e2e
    harness's worker (`verl_p2p/e2e/verl_actor.py`: a real Megatron model through Megatron-Bridge inside verl's
    MegatronEngine class, the checkpoint engine built and `update_weights` run as verl does), plus test hooks."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def scale_weights(self, factor: float) -> None:
        """Stands for an optimizer step: every Megatron parameter of this rank times `factor`."""
        with torch.no_grad():
            for chunk in self.actor.engine.module:
                for param in chunk.parameters():
                    param.mul_(factor)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def p2p_state(self) -> dict:
        """What this rank's p2p engine holds: plan generation, targets, and the identity of its data plane."""
        engine = self.checkpoint_engine
        session = engine._session
        assignment = engine._assignment
        return {
            "role": engine.role.value,
            "generation": None if assignment is None else assignment.generation,
            "assignment_id": id(assignment),
            "targets": [] if assignment is None else [(t.engine, t.rank) for t in assignment.targets],
            "session_id": id(session),
            "transport_id": id(getattr(session, "transport", None)),
            "transport_session": getattr(getattr(session, "transport", None), "session_id", None),
            "replica_ids": sorted(id(r) for r in getattr(session, "_replicas", {}).values()),
            "export_mode": getattr(getattr(session, "exporter", None), "mode", None),
        }


def trainer_config(model_path: str, checkpoint_engine: dict, *, tp: int = 1, ep: int = 1, etp: int | None = None):
    """The slice of verl's `actor_rollout_ref` config the actor worker reads (the e2e harness's builder)."""
    return actor_config(model_path, checkpoint_engine, tp=tp, ep=ep, etp=etp)


def trainer_group(config: Any, world_size: int) -> RayWorkerGroup:
    """verl's RayWorkerGroup of `world_size` actor workers on a CPU resource pool; `init_model` done."""
    pool = RayResourcePool([world_size], use_gpu=False, max_colocate_count=1, name_prefix="p2p_e2e_actor")
    cls = RayClassWithInitArgs(cls=ray.remote(ActorWorkerStandIn), config=config, role="actor")
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, name_prefix="p2p_e2e_actor", device_name="cpu")
    group.init_model()
    return group


# ------------------------------------------------------------------------------------------------ rollout side


class ServerAdapterStandIn:
    """Stand-in for verl's SGLang ServerAdapter inside the rollout's CheckpointEngineWorker.

    Mirrors what verl's reads (`replica_rank`, `rollout_rank` = RANK modulo the replica's world size, node 0)
    and what its `update_weights` does with the checkpoint engine's stream: it loads every received tensor into
    the server (here: counts them), then the server's TP leader flushes the cache and stamps `set_global_steps`.
    """

    def __init__(self, replica_rank: int, world_size: int) -> None:
        self.replica_rank = replica_rank
        self.world_size = world_size
        self.received: list[str] = []
        self.server_actor: Any = None
        self._url: str | None = None

    @property
    def rollout_rank(self) -> int:
        return int(os.environ["RANK"]) % self.world_size

    def _is_server_tp_leader(self) -> bool:
        return self.rollout_rank % self.world_size == 0  # infer_tp local rank 0 (dp = pp = 1)

    async def _init_server_adapter(self) -> None:
        if self._url is not None or not self._is_server_tp_leader():
            return
        self.server_actor = ray.get_actor(f"sglang_server_{self.replica_rank}_0")
        host, port = await self.server_actor.get_server_address.remote()
        self._url = f"http://{host}:{port}"

    async def update_weights(self, weights, global_steps: int = None, wire_format: str = "named_tensors", **kwargs):
        from verl.workers.rollout.utils import ensure_async_iterator

        await self._init_server_adapter()
        async for name, _tensor in ensure_async_iterator(weights):
            self.received.append(name)  # verl would send these to SGLang (update_weights_from_tensor)
        if self._url is not None and self._is_server_tp_leader():
            await asyncio.to_thread(_post, f"{self._url}/flush_cache", None)
            if global_steps is not None:
                await self.server_actor.set_global_steps.remote(global_steps)


class SGLangServerStandIn:
    """Stand-in for verl's SGLangHttpServer (Ray actor `sglang_server_{replica}_{node}`), node 0 of one replica.

    Its control methods call the loopback engine's HTTP endpoints that SGLang's tokenizer manager would act on
    (pause/continue generation, release/resume memory occupation); `set_global_steps` records the stamp.
    """

    def __init__(self, url: str, free_cache_engine: bool, node_rank: int = 0) -> None:
        self.url = url.rstrip("/")
        self.free_cache_engine = free_cache_engine
        self.node_rank = node_rank
        self.global_steps = None
        self.calls: list[str] = []

    def get_server_address(self) -> tuple[str, int]:
        host, port = self.url.split("://", 1)[1].rsplit(":", 1)
        return host, int(port)

    def set_global_steps(self, global_steps: int) -> None:
        self.calls.append("set_global_steps")
        self.global_steps = global_steps

    def abort_all_requests(self, reject_request: bool = False) -> None:
        self.calls.append("abort_all_requests")
        if self.node_rank == 0:
            _post(f"{self.url}/pause_generation", {"mode": "abort"})

    def resume_generation(self) -> None:
        self.calls.append("resume_generation")
        if self.node_rank == 0:
            _post(f"{self.url}/continue_generation", {})

    def release_kv_cache(self) -> None:
        self.calls.append("release_kv_cache")
        if self.node_rank != 0 or not self.free_cache_engine:
            return
        _post(f"{self.url}/release_memory_occupation", {"tags": ["kv_cache"]})

    def resume_kv_cache(self) -> None:
        self.calls.append("resume_kv_cache")
        if self.node_rank != 0 or not self.free_cache_engine:
            return
        _post(f"{self.url}/resume_memory_occupation", {"tags": ["kv_cache"]})
        _post(f"{self.url}/flush_cache", None)

    def state(self) -> dict:
        return {"global_steps": self.global_steps, "calls": list(self.calls)}


def _post(url: str, body: dict | None) -> Any:
    answer = requests.post(url, json=body, timeout=60)
    if answer.status_code != 200:
        raise RuntimeError(f"POST {url} -> {answer.status_code}: {answer.text[:500]}")
    return answer


class LoopbackReplica(RolloutReplica):
    """Stand-in for verl's SGLangReplica over one loopback engine (SGLangReplica's module imports SGLang's server).

    verl's RolloutReplica base does the rest: `init_colocated` builds the replica's workers as verl's real
    CheckpointEngineWorker actors (here on a CPU resource pool, with the ServerAdapter stand-in), and its
    `release_kv_cache`/`resume_kv_cache` go to every server; abort/resume go to the first server, as in
    SGLangReplica.
    """

    def __init__(self, replica_rank: int, config: RolloutConfig, model_config: Any, server_url: str) -> None:
        super().__init__(replica_rank, config, model_config, gpus_per_node=8)
        self.server_url = server_url

    def rollout_worker_use_gpu(self) -> bool:
        return False

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        from verl.checkpoint_engine.base import CheckpointEngineWorker

        return RayClassWithInitArgs(
            cls=ray.remote(CheckpointEngineWorker),
            rollout_config=self.config,
            model_config=self.model_config,
            server_adapter=ServerAdapterStandIn(self.replica_rank, self.world_size),
            replica_rank=self.replica_rank,
        )

    async def launch_servers(self) -> None:
        server = (
            ray.remote(SGLangServerStandIn)
            .options(name=f"sglang_server_{self.replica_rank}_0", num_cpus=0)
            .remote(self.server_url, self.config.free_cache_engine)
        )
        self.servers = [server]
        host, port = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"{host}:{port}"

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        await self.servers[0].abort_all_requests.remote()

    async def resume_generation(self) -> None:
        await self.servers[0].resume_generation.remote()


def rollout_config(
    checkpoint_engine: dict, *, tp: int, bootstrap_port: int, free_cache_engine: bool = True
) -> RolloutConfig:
    """verl's RolloutConfig of one SGLang replica served by a loopback engine."""
    return RolloutConfig(
        name="sglang",
        mode="async",
        tensor_model_parallel_size=tp,
        free_cache_engine=free_cache_engine,
        checkpoint_engine=CheckpointEngineConfig(**checkpoint_engine),
        engine_kwargs={"sglang": {"engine_info_bootstrap_port": bootstrap_port, "host": "127.0.0.1"}},
    )


async def launch_replica(replica: LoopbackReplica) -> LoopbackReplica:
    """verl's colocated launch path (RolloutReplica.init_colocated) on a CPU resource pool of the replica's size."""
    pool = RayResourcePool(
        [replica.world_size], use_gpu=False, max_colocate_count=1, name_prefix=f"p2p_e2e_rollout{replica.replica_rank}"
    )
    await replica.init_colocated(pool)
    assert replica.rollout_mode is RolloutMode.COLOCATED
    return replica

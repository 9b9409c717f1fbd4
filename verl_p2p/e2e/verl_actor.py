"""verl's trainer side as a Ray worker group: a Megatron-Bridge model inside verl's real MegatronEngine class,
on the GPU (`device="cuda"`) or the CPU, building its checkpoint engine the way verl's actor worker does.

Stand-in, named as such, for verl's `ActorRolloutRefWorker` (role "actor", Megatron strategy): verl's worker
builds an optimizer, a full engine config and transformer_engine layers; the sync reads only the engine's
model chunks, bridge and model config. Real: verl's `Worker`, `register`/dispatch, `RayWorkerGroup`,
`MegatronEngine` and `TrainingWorker` classes (made without their constructors), `HFModelConfig`, the
checkpoint-engine registry, megatron-core's parallel state and Megatron-Bridge's load and export.
`init_model`'s checkpoint-engine part and `update_weights` are verl 0.9.1's bodies.

Sharing one GPU with a standalone rollout: verl's standalone replica reserves the GPU through its placement group,
so the trainer's workers are scheduled as CPU workers (no GPU resource) and given the GPU through CUDA_VISIBLE_DEVICES
in their Ray runtime env (`cuda_visible_devices`). Ray >= 2.4x leaves that variable alone for a worker without GPU
ids unless RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1 (scripts/gpu_verl_replica.py sets it to 0), and verl's Worker
re-derives the device only under RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES (not set here).
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
from omegaconf import OmegaConf
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register


class MegatronActorWorker(Worker):
    """Stand-in for verl's ActorRolloutRefWorker (role "actor", actor.strategy=megatron); see the module doc."""

    def __init__(self, config: Any, role: str = "actor", device: str = "cpu", cuda_visible_devices: str = "") -> None:
        if device == "cuda" and cuda_visible_devices and os.environ.get("CUDA_VISIBLE_DEVICES") != cuda_visible_devices:
            # the runtime env sets it; should Ray have overridden it, this helps only while CUDA is not yet initialised
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        Worker.__init__(self)
        self.config = config
        self.role = role
        self.device = device
        self.actor: Any = None
        self.checkpoint_engine: Any = None
        self._initial: dict[str, torch.Tensor] = {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.distributed import initialize_global_process_group_ray
        from verl.utils.import_utils import import_external_libs

        if self.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"trainer worker: no GPU visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
                )
            torch.cuda.set_device(0)
            initialize_global_process_group_ray(timeout_second=300)  # verl's default: cpu:gloo,cuda:nccl
        else:
            initialize_global_process_group_ray(timeout_second=300, backend="gloo")
        self.actor = _training_worker(self.config, self.device)
        with torch.no_grad():
            self._initial = {name: p.detach().clone() for name, p in self._named_parameters()}

        # 4. build checkpoint engine (verl 0.9.1 engine_workers.ActorRolloutRefWorker.init_model, verbatim)
        if "actor" in self.role:
            checkpoint_engine_config = omega_conf_to_dataclass(self.config.rollout.checkpoint_engine)
            backend = checkpoint_engine_config.backend
            bucket_size = checkpoint_engine_config.update_weights_bucket_megabytes << 20
            engine_kwargs = checkpoint_engine_config.engine_kwargs.get(backend, {})
            import_external_libs(checkpoint_engine_config.custom_backend_module or None)
            self.checkpoint_engine = CheckpointEngineRegistry.new(
                backend, is_master=(torch.distributed.get_rank() == 0), bucket_size=bucket_size, **engine_kwargs
            )
        first = next(iter(self._initial.values()))
        return {
            "training_worker": getattr(self.actor, "import_error", None) or type(self.actor).__qualname__,
            "device": str(first.device),
            "dtype": str(first.dtype),
            "parameters": len(self._initial),
            "engine": type(self.actor.engine).__module__ + "." + type(self.actor.engine).__qualname__,
            "checkpoint_engine": type(self.checkpoint_engine).__module__
            + "."
            + type(self.checkpoint_engine).__qualname__,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpu_name": torch.cuda.get_device_name(0) if self.device == "cuda" else None,
            "pid": os.getpid(),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        """verl's update_weights for a non-naive backend (engine_workers.py), verbatim."""
        effective_mode = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
        if effective_mode != "naive":
            if effective_mode == "delta_sharded":
                metrics = await self.checkpoint_engine.send_weights(self.actor.engine, global_steps=global_steps)
                return metrics or {}
            per_tensor_param, _ = self.actor.engine.get_per_tensor_param()
            metrics = await self.checkpoint_engine.send_weights(per_tensor_param, global_steps=global_steps)
            return metrics or {}
        raise NotImplementedError("stand-in: the colocated (naive) sync needs verl's hybrid engine")

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    # ---- harness hooks (not verl's) -------------------------------------------------------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_weights(self, factor: float) -> None:
        """Stands for an optimizer step: every Megatron parameter = its loaded value x `factor` (a power of two
        keeps this exact in bf16 and float32, so the rollout's bytes are predictable)."""
        with torch.no_grad():
            for name, param in self._named_parameters():
                param.copy_(self._initial[name] * factor)
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _named_parameters(self):
        for index, chunk in enumerate(self.actor.engine.module):
            for name, param in chunk.named_parameters():
                yield f"{index}.{name}", param


def _training_worker(config: Any, device: str) -> Any:
    """verl's TrainingWorker holding verl's MegatronEngine class over a Megatron-Bridge model of the checkpoint.

    MegatronEngine's own `__init__`/`initialize` need verl's full engine config and build an optimizer, so the
    instance is made without them and given the attributes its export (`get_per_tensor_param`) reads. On the CPU,
    verl's move of the parameters to the GPU (`load_megatron_model_to_gpu`) is made the identity.
    """
    from verl_p2p.sandbox.cpu_megatron import Parallel, build_tiny_megatron, install_te_stub

    install_te_stub()  # megatron-core's modules first, then the import-only transformer_engine stub
    if device == "cpu":
        from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

        install_cpu_stubs()  # SGLang's model classes (the p2p replica) on a host without GPU kernels
    from verl.workers.config import HFModelConfig
    from verl.workers.engine.megatron import transformer_impl
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    if device == "cpu":
        transformer_impl.load_megatron_model_to_gpu = lambda *args, **kwargs: None
    megatron = config.actor.megatron
    par = Parallel(
        tp=megatron.tensor_model_parallel_size,
        pp=megatron.pipeline_model_parallel_size,
        ep=megatron.expert_model_parallel_size,
        etp=megatron.expert_tensor_parallel_size,
    )
    dtype = getattr(torch, config.actor.megatron.get("dtype", "float32"))
    modules, bridge = build_tiny_megatron(config.model.path, par, device=device, dtype=dtype)
    engine = object.__new__(MegatronEngine)
    engine.module = modules
    engine.bridge = bridge
    engine.model_config = HFModelConfig(path=config.model.path, load_tokenizer=False)
    engine.vanilla_bridge = False
    engine.peft_cls = None
    engine._qat_enabled = False
    engine._hf_export_tasks = None
    engine._is_offload_param = False
    engine._is_offload_optimizer = False
    try:
        from verl.workers.engine_workers import TrainingWorker

        actor = object.__new__(TrainingWorker)
    except ImportError as exc:  # the engine is what the sync reads (`worker.actor.engine`); say what stood in
        actor = types.SimpleNamespace(import_error=f"verl.workers.engine_workers: {type(exc).__name__}: {exc}")
    actor.engine = engine
    return actor


def actor_config(
    model_path: str,
    checkpoint_engine: dict,
    *,
    dtype: str = "float32",
    tp: int = 1,
    ep: int = 1,
    etp: int | None = None,
) -> Any:
    """The slice of verl's `actor_rollout_ref` config the actor worker reads (OmegaConf, as verl passes it)."""
    return OmegaConf.create(
        {
            "hybrid_engine": False,
            "model": {"path": str(model_path)},
            "actor": {
                "strategy": "megatron",
                "megatron": {
                    "tensor_model_parallel_size": tp,
                    "pipeline_model_parallel_size": 1,
                    "expert_model_parallel_size": ep,
                    "expert_tensor_parallel_size": etp,
                    # harness only: the Megatron parameter dtype (verl derives it from its mixed-precision config)
                    "dtype": dtype,
                },
            },
            "rollout": {
                "name": "sglang",
                "checkpoint_engine": {"_target_": "verl.workers.config.CheckpointEngineConfig", **checkpoint_engine},
            },
        }
    )


def actor_group(config: Any, world_size: int, *, device: str, cuda_visible_devices: str = "", name: str = "p2p_actor"):
    """verl's RayWorkerGroup of `world_size` actor workers on a CPU resource pool (the GPU, when `device="cuda"`,
    through `cuda_visible_devices`); returns (group, the first worker's `init_model` answer)."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([world_size], use_gpu=False, max_colocate_count=1, name_prefix=name)
    cls = RayClassWithInitArgs(
        cls=ray.remote(MegatronActorWorker),
        config=config,
        role="actor",
        device=device,
        cuda_visible_devices=cuda_visible_devices,
    )
    worker_env = {"CUDA_VISIBLE_DEVICES": cuda_visible_devices} if device == "cuda" else {}
    group = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=cls, name_prefix=name, device_name="cpu", worker_env=worker_env
    )
    answers = group.init_model()
    return group, answers[0] if isinstance(answers, list) else answers

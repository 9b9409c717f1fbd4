"""A real FSDP2 (or FSDP1) actor on gloo CPU ranks, streamed by verl's own
`FSDPEngineWithLMHead.get_per_tensor_param()`, pushed by p2p's full-stream source into receiver processes
(tests/test_fsdp_source.py), directly through the source session or (`verl_syncs`) as verl syncs: its
`ActorRolloutRefWorker.update_weights` into p2p's `send_weights`.

Real: the HF model (transformers), `fully_shard` over a CPU device mesh, verl's engine class and its stream
method, verl's worker classes holding it, and p2p's `SourceSession` (engine lookup, export, apply: replicas from
SGLang's model classes with their programs checked against SGLang's loader; push: go/no-go with the stream
digest, pre-launch stream checks, Mooncake writes) under the full-stream plan. Stand-ins, named:

- the engine instance is made with `object.__new__` and given the attributes verl's `initialize()` sets
  (`module`, `model_config`, offload flags): `FSDPEngine.__init__`/`initialize()` build a CUDA device mesh and are
  registered for `device=["cuda", "npu"]` only;
- module-level lookups of verl's FSDP engine module and of `verl.utils.fsdp_utils` are pointed at the CPU
  (`get_device_id`, `get_device_name`, and `log_gpu_memory_usage`, which reads CUDA's memory info): verl's platform
  layer asks CUDA for its current device on a host without a driver;
- FSDP1 only: `sync_module_states=False` (`fsdp1_engine`).

The stream's own code (state_dict, full_tensor gathers, renaming, MoE unfusing) runs as verl ships it.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from verl_p2p.transfer.base import TransportProxy

TIMEOUT_S = 20.0


@dataclass
class RankJob:
    """What one FSDP rank does: its place, the model, the targets (published infos) and their server args."""

    rank: int
    world: int
    port: int
    model_dir: str
    server_args: dict[int, dict]  # engine -> SGLang server args
    remote_infos: dict[Any, Any]  # TargetRank -> RemoteRankInfo
    dies_after_writes: int = 0  # > 0: this rank's Mooncake endpoint dies after that many write calls
    repush: bool = False  # after a failure: re-push the unknown targets from the surviving ranks
    verl_syncs: int = 0  # > 0: that many syncs through verl's own `ActorRolloutRefWorker.update_weights`
    strategy: str = "fsdp2"  # verl's actor.strategy: "fsdp2" (fully_shard) or "fsdp" (FullyShardedDataParallel)
    param_offload: bool = False  # FSDP1: verl's actor.fsdp_config.param_offload (see fsdp1_engine)
    results: dict[str, Any] = field(default_factory=dict)


def cpu_platform_for_verl_fsdp() -> None:
    """The named stand-in (module docstring): verl's FSDP engine module asks CUDA for its device and memory, and
    its FSDP1 staging (`fsdp_utils.load_fsdp_model_to_gpu`) moves flat params to `<device name>:<device id>`."""
    from verl.utils import fsdp_utils
    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.get_device_id = lambda: "cpu"
    transformer_impl.log_gpu_memory_usage = lambda *args, **kwargs: None
    fsdp_utils.get_device_name = lambda: "cpu"
    fsdp_utils.get_device_id = lambda: 0


def fsdp1_engine(model_dir: str, world: int, param_offload: bool = False) -> Any:
    """verl's FSDPEngineWithLMHead over an FSDP1 (`FullyShardedDataParallel`) HF model on a CPU mesh of `world`
    ranks, wrapped as verl 0.9.1's `_build_fsdp_module` wraps it for `actor.strategy=fsdp` (its auto-wrap policy,
    sharding strategy and default mixed precision: bf16 compute over fp32 flat params; the sharded state-dict type
    its `initialize()` sets for several ranks). Stand-in: `sync_module_states=False`, since torch's FSDP1 refuses
    it for CPU modules (every rank loads the same checkpoint, which is what the broadcast would give).
    `param_offload`: verl's flag, so that its staging around the state dict (load to the device, offload after)
    and p2p's own for the stream's manifest run; on a CPU host both ends of that move are host memory."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.api import ShardedStateDictConfig, StateDictType
    from transformers import AutoModelForCausalLM
    from verl.utils.fsdp_utils import get_fsdp_wrap_policy
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine.fsdp.utils import get_sharding_strategy

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    module = FullyShardedDataParallel(
        model,
        auto_wrap_policy=get_fsdp_wrap_policy(module=model, config=None, is_lora=False),
        device_id=torch.device("cpu"),
        sharding_strategy=get_sharding_strategy(mesh, zero3_enable=True),
        mixed_precision=MixedPrecision(torch.bfloat16, torch.float32, torch.float32),
        sync_module_states=False,
        device_mesh=mesh,
        use_orig_params=False,
    )
    FullyShardedDataParallel.set_state_dict_type(
        module, state_dict_type=StateDictType.SHARDED_STATE_DICT, state_dict_config=ShardedStateDictConfig()
    )
    engine = object.__new__(FSDPEngineWithLMHead)  # stand-in for __init__/initialize (CUDA only)
    engine.module = module
    engine.model_config = SimpleNamespace(lora={}, hf_config=model.config, local_path=model_dir)
    engine._is_offload_param = param_offload
    engine._uses_fsdp2_cpu_offload_policy = False
    engine._qat_enabled = False
    return engine


def fsdp2_engine(model_dir: str, world: int, num_hidden_layers: int | None = None, lora_merge: bool | None = None):
    """verl's FSDPEngineWithLMHead over an FSDP2 (`fully_shard`) HF model on a CPU mesh of `world` ranks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    overrides = {}
    if num_hidden_layers is not None:  # transformers keeps one attention type per layer
        overrides = {"num_hidden_layers": num_hidden_layers, "layer_types": ["full_attention"] * num_hidden_layers}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **overrides)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = object.__new__(FSDPEngineWithLMHead)  # stand-in for __init__/initialize (CUDA only)
    engine.module = model
    engine.model_config = SimpleNamespace(
        lora={} if lora_merge is None else {"merge": lora_merge}, hf_config=model.config, local_path=model_dir
    )
    engine._is_offload_param = False
    engine._uses_fsdp2_cpu_offload_policy = False
    engine._qat_enabled = False
    return engine


def actor_worker(engine: Any) -> Any:
    """verl's own worker classes holding `engine` where verl 0.9.1 keeps it (`worker.actor.engine`)."""
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    actor = object.__new__(TrainingWorker)
    actor.engine = engine
    worker = object.__new__(ActorRolloutRefWorker)
    worker.actor = actor
    return worker


class DiesAfter(TransportProxy):
    """A Mooncake endpoint that is gone for good after `calls` write calls (its NIC or process died)."""

    def __init__(self, inner: Any, calls: int) -> None:
        self.inner, self.left, self.written = inner, calls, 0

    def write(self, session_id, local_addrs, remote_addrs, lengths) -> None:
        from verl_p2p.errors import TransferError

        if self.left <= 0:
            raise TransferError(f"source endpoint {self.inner.session_id} is gone")
        self.left -= 1
        self.inner.write(session_id, local_addrs, remote_addrs, lengths)
        self.written += sum(lengths)


def run_rank(job: RankJob, queue: Any) -> None:
    """Child entry: one FSDP rank; puts `(rank, results)` on `queue` (results['error'] on failure)."""
    try:
        _run(job)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        job.results["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    queue.put((job.rank, job.results))


def _run(job: RankJob) -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=job.rank, world_size=job.world, timeout=datetime.timedelta(seconds=120))
    from verl_p2p.config import P2PConfig
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.trainer.source import SourceSession

    install_cpu_stubs()
    cpu_platform_for_verl_fsdp()
    if job.dies_after_writes:  # this rank's Mooncake endpoint, as the session opens it, dies mid-stream
        from verl_p2p.transfer import mooncake

        real = mooncake.MooncakeTransport
        mooncake.MooncakeTransport = lambda *a, **k: DiesAfter(real(*a, **k), job.dies_after_writes)
    engine = (
        fsdp1_engine(job.model_dir, job.world, job.param_offload)
        if job.strategy == "fsdp"
        else fsdp2_engine(job.model_dir, job.world)
    )
    config = P2PConfig(
        protocol="tcp", hostname="127.0.0.1", bucket_size_mb=1, p2p_transfer_timeout=TIMEOUT_S, plan_cache_dir=""
    )
    if job.verl_syncs:
        job.results.update(_verl_syncs(job, engine))
        dist.destroy_process_group()
        return
    session = SourceSession(config, actor_worker(engine), hostname="127.0.0.1")  # finds verl's FSDP engine
    out = job.results
    try:
        out["sync"] = _sync(job, session, generation=1)
        if job.repush and "unknown" in out["sync"]:
            out["repush"] = _sync(job, session, 2, only=out["sync"]["unknown"], dead=out["sync"]["dead"])
    finally:
        session.close()
        dist.destroy_process_group()


def full_stream_assignment(
    rank: int, world: int, generation: int, job: RankJob, targets: list, dead: list | None = None
) -> Any:
    """This rank's Assignment from the driver's own `assign` (FSDP sources: `full_stream=True`), with the dead
    ranks excluded as the manager's re-push excludes them."""
    from verl_p2p.backend.topology import SourceMeta, assign
    from verl_p2p.planning.layout import layout_from_server_args

    sources = [SourceMeta(r, 0, 1, generation - 1, full_stream=True) for r in range(world)]
    infos = {t: job.remote_infos[t] for t in targets}
    layouts = {t: layout_from_server_args(job.server_args[t.engine], t.rank) for t in targets}
    return assign(sources, job.server_args, infos, layouts, generation, exclude=dead or ())[rank]


def _sync(job: RankJob, session: Any, generation: int, only: list | None = None, dead: list | None = None) -> dict:
    """One sync of this rank through the real source session: apply the full-stream plan, push."""
    import torch.distributed as dist

    from verl_p2p.errors import TransferError
    from verl_p2p.planning.fsdp import build_full_stream_plan, full_stream_sources
    from verl_p2p.planning.targets import TargetRank

    sources = [s for s in full_stream_sources(job.world) if s.global_rank not in (dead or [])]
    targets = [TargetRank(*t) for t in only] if only is not None else sorted(job.remote_infos)
    plan = build_full_stream_plan(sources, targets)  # what the driver plans: read for the parts' indices below
    assignment = full_stream_assignment(job.rank, job.world, generation, job, targets, dead)
    assert set(assignment.targets) == set(plan.targets_of(job.rank)), (assignment.targets, plan.targets_of(job.rank))
    session.apply(assignment)
    out: dict[str, Any] = {
        "mode": session.exporter.mode,
        "parts": {str(t): plan.part_of(job.rank, t) for t in assignment.targets},
    }
    seen: list[tuple[str, tuple[int, ...], Any]] = []
    original = session.stream

    def recorded(weights=None):  # what verl streamed, beside the manifest the pre-launch checks used
        for name, tensor in original(weights):
            seen.append((name, tuple(tensor.shape), tensor.dtype))
            yield name, tensor
        if assignment.targets:
            out["stream_is_manifest"] = seen == [(e.name, e.shape, e.dtype) for e in session.exporter.manifest()]

    session.stream = recorded
    try:
        metrics = session.push()
        out["bytes_per_target"] = {str(t): n for t, n in (metrics.bytes_per_target if metrics else {}).items()}
    except TransferError as exc:
        out["failed"] = f"{type(exc).__name__}: {exc}"
        out["unknown"] = [(t.engine, t.rank) for t in sorted(exc.unknown_targets)]
        out["dead"] = [job.rank]
    finally:
        del session.stream
    # every rank learns who died and what is unknown, as the driver would from the push outcomes
    gathered: list[Any] = [None] * job.world
    dist.all_gather_object(gathered, (out.get("unknown", []), out.get("dead", [])))
    out["unknown"] = sorted({tuple(t) for u, _ in gathered for t in u})
    out["dead"] = sorted({r for _, d in gathered for r in d})
    if not out["unknown"]:
        del out["unknown"], out["dead"]
    return out


class StreamCounter:
    """Counts, per sync, the calls of the engine's `get_per_tensor_param` (an instance wrapper around verl's own
    method) and the DTensor `full_tensor()` gathers (a class wrapper: every gather of any stream or prediction)."""

    def __init__(self, engine: Any) -> None:
        from torch.distributed.tensor import DTensor

        self.calls = self.gathers = 0
        real_stream, real_gather = engine.get_per_tensor_param, DTensor.full_tensor

        def get_per_tensor_param(*args, **kwargs):
            self.calls += 1
            return real_stream(*args, **kwargs)

        def full_tensor(tensor, *args, **kwargs):
            self.gathers += 1
            return real_gather(tensor, *args, **kwargs)

        engine.get_per_tensor_param = get_per_tensor_param
        DTensor.full_tensor = full_tensor

    def take(self) -> tuple[int, int]:
        """(calls, gathers) since the last take."""
        counts, self.calls, self.gathers = (self.calls, self.gathers), 0, 0
        return counts


def _verl_syncs(job: RankJob, engine: Any) -> dict:
    """`job.verl_syncs` syncs as verl runs them: `P2PCheckpointEngine` built with verl's trainer arguments and held
    by verl's worker as its `checkpoint_engine`, given this rank's full-stream assignment (`init_process_group`),
    then verl's own `ActorRolloutRefWorker.update_weights`, which streams the engine and calls `send_weights`."""
    import asyncio

    from omegaconf import OmegaConf
    from torch.distributed.tensor import DTensor

    from verl_p2p.backend.engine import P2PCheckpointEngine

    worker = actor_worker(engine)
    worker.config = OmegaConf.create({"rollout": {"checkpoint_engine": {"backend": "verl_p2p"}}})
    worker.checkpoint_engine = P2PCheckpointEngine(
        1 << 20, is_master=job.rank == 0, protocol="tcp", hostname="127.0.0.1", bucket_size_mb=1,
        p2p_transfer_timeout=TIMEOUT_S, plan_cache_dir="",
    )  # fmt: skip
    worker.checkpoint_engine.init_process_group(
        assignment=full_stream_assignment(job.rank, job.world, 1, job, sorted(job.remote_infos))
    )
    dtensors = sum(isinstance(t, DTensor) for t in engine.module.state_dict().values())
    counter = StreamCounter(engine)
    dtypes = sorted({str(p.dtype) for p in engine.module.parameters()})
    out: dict[str, Any] = {"dtensors": dtensors, "param_dtypes": dtypes, "calls": [], "gathers": [], "metrics": []}
    try:
        for step in range(1, job.verl_syncs + 1):
            out["metrics"].append(asyncio.run(worker.update_weights(global_steps=step)))
            calls, gathers = counter.take()
            out["calls"].append(calls)
            out["gathers"].append(gathers)
    finally:
        worker.checkpoint_engine._session.close()
    return out

"""A real FSDP2 actor on gloo CPU ranks, streamed by verl's own `FSDPEngineWithLMHead.get_per_tensor_param()`,
pushed by p2p's full-stream source into receiver processes (tests/test_fsdp_source.py).

Real: the HF model (transformers), `fully_shard` over a CPU device mesh, verl's engine class and its stream
method, verl's worker classes holding it, p2p's engine lookup, export, plan, replicas (SGLang's model classes),
push and Mooncake writes. Stand-ins, named:

- the engine instance is made with `object.__new__` and given the attributes verl's `initialize()` sets
  (`module`, `model_config`, offload flags): `FSDPEngine.__init__`/`initialize()` build a CUDA device mesh and are
  registered for `device=["cuda", "npu"]` only;
- two module-level lookups of verl's FSDP engine module are pointed at the CPU (`get_device_id`, and
  `log_gpu_memory_usage`, which reads CUDA's memory info): verl's platform layer asks CUDA for its current device
  on a host without a driver. The stream's own code (state_dict, full_tensor gathers, renaming, MoE unfusing) runs
  as verl ships it.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SLOT_BYTES = 24 * 1024  # smaller than the largest parameter: chunked loads
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
    extra_layer_on: int | None = None  # this rank builds its model with one more layer (a disagreeing stream)
    results: dict[str, Any] = field(default_factory=dict)


def cpu_platform_for_verl_fsdp() -> None:
    """The named stand-in (module docstring): verl's FSDP engine module asks CUDA for its device and memory."""
    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.get_device_id = lambda: "cpu"
    transformer_impl.log_gpu_memory_usage = lambda *args, **kwargs: None


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


class DiesAfter:
    """A Mooncake endpoint that is gone for good after `calls` write calls (its NIC or process died)."""

    def __init__(self, inner: Any, calls: int) -> None:
        self.inner, self.left, self.written = inner, calls, 0

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, addr: int, nbytes: int) -> None:
        self.inner.register(addr, nbytes)

    def unregister(self, addr: int) -> None:
        self.inner.unregister(addr)

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
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()
    cpu_platform_for_verl_fsdp()
    layers = None
    if job.extra_layer_on == job.rank:
        import json

        layers = json.loads((Path(job.model_dir) / "config.json").read_text())["num_hidden_layers"] + 1
    engine = fsdp2_engine(job.model_dir, job.world, num_hidden_layers=layers)
    out = job.results
    try:
        out["sync"] = _sync(job, engine, dying=job.dies_after_writes)
        if job.repush and "unknown" in out["sync"]:
            out["repush"] = _sync(job, engine, dying=0, only=out["sync"]["unknown"], dead=out["sync"]["dead"])
    finally:
        dist.destroy_process_group()


def _sync(job: RankJob, engine: Any, dying: int, only: list | None = None, dead: list | None = None) -> dict:
    """One sync of this rank: plan, replicas, checks, go/no-go, verl's stream into the push."""
    import torch.distributed as dist

    from verl_p2p.errors import TransferError
    from verl_p2p.planning.fsdp import build_full_stream_plan, full_stream_sources
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.planning.targets import TargetRank
    from verl_p2p.replica.compiled import CompiledReplica
    from verl_p2p.replica.stream import RankReplica
    from verl_p2p.trainer.exports import check_stream, stream_digest
    from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint
    from verl_p2p.trainer.push import PushTarget, check_push, push
    from verl_p2p.trainer.senders import ExportStage, agree_to_export, drain, drive_export
    from verl_p2p.trainer.verl_engine import engine_exporter, export_engine_stage, find_training_engine
    from verl_p2p.transfer.buffers import TransferBuffers
    from verl_p2p.transfer.mooncake import MooncakeTransport
    from verl_p2p.transfer.writer import Writer

    found = find_training_engine(actor_worker(engine))
    exporter = engine_exporter(found)
    sources = [s for s in full_stream_sources(job.world) if s.global_rank not in (dead or [])]
    targets = sorted(only if only is not None else job.remote_infos)
    targets = [TargetRank(*t) if not isinstance(t, TargetRank) else t for t in targets]
    plan = build_full_stream_plan(sources, targets)
    mine = plan.targets_of(job.rank)
    stage = ExportStage(job.rank, 0, 1, tuple(range(job.world)), tuple(plan.senders()))
    specs = hf_specs_from_checkpoint(job.model_dir)
    import json

    cfg = json.loads((Path(job.model_dir) / "config.json").read_text())
    push_targets, error, checked = [], None, None
    transport = buffers = writer = None
    try:
        for t in mine:
            args = job.server_args[t.engine]
            replica = RankReplica.build(cfg, args, layout_from_server_args(args, t.rank), specs)
            executor = CompiledReplica(replica)
            executor.prepare_push(SLOT_BYTES)
            push_targets.append(PushTarget(t, executor, job.remote_infos[t], plan.part_of(job.rank, t)))
        if push_targets:
            transport = MooncakeTransport("127.0.0.1", protocol="tcp", timeout_s=TIMEOUT_S)
            endpoint = DiesAfter(transport, dying) if dying else transport
            buffers = TransferBuffers(SLOT_BYTES, endpoint)
            writer = Writer(endpoint, {t.target: t.remote for t in push_targets}, timeout_s=TIMEOUT_S, num_workers=2)
            checked = check_push(push_targets, writer)
            check_stream(exporter, checked, ())
    except Exception as exc:  # agreed below, as the source session does
        error = exc
    digest, error = stream_digest(exporter, error)
    out: dict[str, Any] = {"mode": exporter.mode, "parts": {str(t): plan.part_of(job.rank, t) for t in mine}}
    try:
        agree_to_export(job.rank, None, error, digest)
    except Exception as exc:  # noqa: BLE001 - every rank reports the same refusal
        out["refused"] = f"{type(exc).__name__}: {exc}"
        return out
    seen: list[tuple[str, tuple[int, ...], Any]] = []
    out["stream_is_manifest"] = None  # set once the stream ran: what verl yielded equals the predicted manifest

    def recorded(stream):
        for name, tensor in stream:
            seen.append((name, tuple(tensor.shape), tensor.dtype))
            yield name, tensor
        out["stream_is_manifest"] = seen == [(e.name, e.shape, e.dtype) for e in exporter.manifest()]
        out["streamed"] = len(seen)

    stream = drive_export(stage, recorded(export_engine_stage(exporter, found)))
    try:
        if push_targets:
            metrics = push(stream, push_targets, buffers, writer, checked=checked)
            out["bytes_per_target"] = {str(t): n for t, n in metrics.bytes_per_target.items()}
            out["peak_staged_bytes"] = metrics.peak_staged_bytes
        else:  # no targets: the stream's gathers only (drive_export yields nothing here)
            for _ in stream:
                pass
            out["bytes_per_target"] = {}
    except TransferError as exc:
        drain(stream, exc)
        out["failed"] = f"{type(exc).__name__}: {exc}"
        out["unknown"] = [(t.engine, t.rank) for t in sorted(exc.unknown_targets)]
        out["dead"] = [job.rank]
    finally:
        if writer is not None:
            writer.close()
        if buffers is not None:
            buffers.release(settle_timeout_s=0.0)
    # every rank learns who died and what is unknown, as the driver would from the push outcomes
    gathered: list[Any] = [None] * job.world
    dist.all_gather_object(gathered, (out.get("unknown", []), out.get("dead", [])))
    out["unknown"] = sorted({tuple(t) for u, _ in gathered for t in u})
    out["dead"] = sorted({r for _, d in gathered for r in d})
    if not out["unknown"]:
        del out["unknown"], out["dead"]
    return out

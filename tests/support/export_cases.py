"""What each spawned rank runs for the export tests: build tiny Megatron models, export, compare, report.

Ranks compare tensors themselves and return only names, mismatch lists and timings; the test process asserts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_p2p.sandbox.cpu_megatron import Parallel, build_tiny_megatron, init_distributed


@dataclass(frozen=True)
class ModelCase:
    label: str
    hf_dir: str
    par: Parallel


@dataclass
class StageReport:
    """One rank's findings for one model."""

    label: str
    rank: int
    pp_rank: int
    tp_rank: int
    stage_ranks: tuple[int, ...]
    local_names: list[str]
    full_names: list[str]
    local_vs_full_mismatch: list[str]
    local_vs_checkpoint_mismatch: list[str]
    filtered_names: list[str]
    filtered_vs_local_mismatch: list[str]
    guard_ops: list[tuple[str, tuple[int, ...]]]
    local_s: float
    full_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def add_mtp_tensors(hf_dir: str | Path) -> Path:
    """Give a tiny Qwen3 checkpoint one MTP layer (`num_nextn_predict_layers=1`) with id-encoded tensors named
    the way Megatron-Bridge's Qwen3 mapping expects (tiny.py writes no MTP tensors)."""
    import json

    from safetensors.torch import load_file, save_file

    path = Path(hf_dir)
    tensors = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    layer = "mtp.layers.0"
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        f"{layer}.input_layernorm.weight": (h,),
        f"{layer}.self_attn.q_norm.weight": (hd,),
        f"{layer}.self_attn.k_norm.weight": (hd,),
        f"{layer}.self_attn.q_proj.weight": (q, h),
        f"{layer}.self_attn.k_proj.weight": (kv, h),
        f"{layer}.self_attn.v_proj.weight": (kv, h),
        f"{layer}.self_attn.o_proj.weight": (h, q),
        f"{layer}.post_attention_layernorm.weight": (h,),
        f"{layer}.mlp.gate_proj.weight": (inter, h),
        f"{layer}.mlp.up_proj.weight": (inter, h),
        f"{layer}.mlp.down_proj.weight": (h, inter),
    }
    next_id = int(max(t.max().item() for t in tensors.values())) + 1
    for name, shape in shapes.items():
        numel = int(torch.Size(shape).numel())
        tensors[name] = torch.arange(next_id, next_id + numel, dtype=torch.float32).reshape(shape)
        next_id += numel
    assert next_id < 2**24, "id encoding must stay exact in float32"
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def quiet_logs() -> None:
    logging.disable(logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore")


def stage_ranks_of(pp_rank: int) -> tuple[int, ...]:
    """Global ranks of pipeline stage `pp_rank`, from one all_gather_object (outside any guard)."""
    from megatron.core import parallel_state as mpu

    world = torch.distributed.get_world_size()
    pp = [None] * world
    torch.distributed.all_gather_object(pp, mpu.get_pipeline_model_parallel_rank())
    return tuple(r for r in range(world) if pp[r] == pp_rank)


def _mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    bad = []
    for name, tensor in got.items():
        ref = want.get(name)
        if ref is None or ref.dtype != tensor.dtype or ref.shape != tensor.shape or not torch.equal(ref, tensor):
            bad.append(name)
    return bad


def check_model(case: ModelCase) -> StageReport:
    """Build one model and compare its PP-local export with the full export, the checkpoint and the fallback."""
    from megatron.core import parallel_state as mpu
    from safetensors.torch import load_file

    from verl_p2p.trainer.export import StageExporter
    from verl_p2p.trainer.stage_guard import stage_collective_guard

    modules, bridge = build_tiny_megatron(case.hf_dir, case.par)
    rank = torch.distributed.get_rank()
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    stage = stage_ranks_of(pp_rank)
    checkpoint = load_file(str(Path(case.hf_dir) / "model.safetensors"))

    exporter = StageExporter(modules, bridge, mode="auto")
    assert exporter.mode == "pp_local", exporter.choice
    t0 = time.perf_counter()
    with stage_collective_guard(stage) as log:
        local = {name: t.detach().clone() for name, t in exporter.export(cpu=True)}
    local_s = time.perf_counter() - t0
    local_names = list(local)  # stream order

    torch.distributed.barrier()
    t0 = time.perf_counter()
    full = {name: t.detach().clone() for name, t in bridge.export_hf_weights(modules, cpu=True, show_progress=False)}
    full_s = time.perf_counter() - t0

    filtered = {n: t.detach().clone() for n, t in StageExporter(modules, bridge, mode="filter_full").export(cpu=True)}

    return StageReport(
        label=case.label,
        rank=rank,
        pp_rank=pp_rank,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        stage_ranks=stage,
        local_names=local_names,
        full_names=list(full),
        local_vs_full_mismatch=_mismatches(local, full),
        local_vs_checkpoint_mismatch=_mismatches(local, checkpoint),
        filtered_names=list(filtered),
        filtered_vs_local_mismatch=_mismatches(filtered, local),
        guard_ops=sorted({(c.op, c.ranks) for c in log.calls}),
        local_s=local_s,
        full_s=full_s,
    )


def guard_fires_on_cross_stage_broadcast(stage: tuple[int, ...]) -> str:
    """Every rank broadcasts over WORLD under the guard: each must raise before communicating."""
    from verl_p2p.trainer.stage_guard import CrossStageCollectiveError, stage_collective_guard

    t = torch.zeros(4)
    try:
        with stage_collective_guard(stage):
            torch.distributed.broadcast(t, src=0)
    except CrossStageCollectiveError as err:
        return str(err)
    return ""


def run_cases(rank: int, world: int, port: int, cases: list[ModelCase], extra: str | None = None) -> dict:
    """Entry of each spawned rank: every model case, then the guard's own check (and an optional scenario)."""
    quiet_logs()
    init_distributed(rank, world, port)
    reports = [check_model(case) for case in cases]
    out: dict[str, Any] = {"reports": reports}
    from megatron.core import parallel_state as mpu

    out["guard_error"] = guard_fires_on_cross_stage_broadcast(stage_ranks_of(mpu.get_pipeline_model_parallel_rank()))
    if extra == "fewer_targets":
        out["drive"] = fewer_targets_than_ranks(cases[0])
    if extra == "verl_engine":
        out["engine"] = verl_engine_export(cases[0])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return out


def fewer_targets_than_ranks(case: ModelCase) -> dict:
    """A plan with one rollout target: one sender per stage writes, the other ranks drain; nothing hangs."""
    from megatron.core import parallel_state as mpu

    from verl_p2p.planning.plan import build_transfer_plan
    from verl_p2p.planning.targets import TargetRank
    from verl_p2p.trainer.export import StageExporter
    from verl_p2p.trainer.senders import drive_export, gather_sources, stage_of
    from verl_p2p.trainer.stage_guard import stage_collective_guard

    modules, bridge = build_tiny_megatron(case.hf_dir, case.par)
    sources = gather_sources()
    plan = build_transfer_plan(sources, [TargetRank(0, 0)], split=False)  # one sender, the others drain
    stage = stage_of(torch.distributed.get_rank(), sources, plan)
    exporter = StageExporter(modules, bridge)
    written: dict[str, torch.Tensor] = {}
    t0 = time.perf_counter()
    with stage_collective_guard(stage.ranks):
        for name, tensor in drive_export(stage, exporter.export(cpu=True)):
            written[name] = tensor.clone()  # stands in for the write to the target
    seconds = time.perf_counter() - t0
    torch.distributed.barrier()
    expected = {n: t.clone() for n, t in exporter.export(cpu=True)}  # same stage, everyone iterating
    return {
        "rank": stage.rank,
        "pp_rank": mpu.get_pipeline_model_parallel_rank(),
        "is_sender": stage.is_sender,
        "senders": stage.senders,
        "written": sorted(written),
        "expected": sorted(expected),
        "mismatch": _mismatches(written, expected),
        "seconds": seconds,
    }


def verl_engine_export(case: ModelCase) -> dict:
    """verl's real MegatronEngine class holding the chunks and bridge (its __init__ needs a GPU): exporter path."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from verl_p2p.trainer.verl_engine import engine_exporter, export_engine_stage, find_megatron_engine

    modules, bridge = build_tiny_megatron(case.hf_dir, case.par)
    engine = object.__new__(MegatronEngine)
    engine.module, engine.bridge = modules, bridge
    engine.vanilla_bridge, engine._qat_enabled, engine.peft_cls, engine._is_offload_param = False, False, None, False
    found = find_megatron_engine(engine)
    exporter = engine_exporter(found)
    names = [n for n, _ in export_engine_stage(exporter, found, cpu=True)]
    engine._qat_enabled = True  # QAT forces the fallback, which filters verl's own get_per_tensor_param stream
    engine.get_per_tensor_param = lambda: (bridge.export_hf_weights(modules, cpu=True, show_progress=False), None)
    fallback = engine_exporter(engine)
    fallback_names = [n for n, _ in export_engine_stage(fallback, engine, cpu=True)]
    return {
        "mode": exporter.mode,
        "names": names,
        "fallback_mode": fallback.mode,
        "fallback_reason": fallback.choice.reason,
        "fallback_names": fallback_names,
    }

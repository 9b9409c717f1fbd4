"""One SGLang rollout rank on CPU, built through SGLang's real distributed path: the independent witness.

Called in each of `tp_size` processes: it joins a real gloo world, runs SGLang's own parallel setup
(`init_distributed_environment`, `initialize_model_parallel`, DP-attention, MoE config, global server
args, expert-location map: what SGLang's scheduler and ModelRunner do before loading) and loads the HF
checkpoint with SGLang's own model loader. The trainer-side replica fakes all of this in one process;
this module shares no code with it, so agreement between the two is evidence, not tautology.

CPU stand-in notes: `device` is forced to "cpu" (no kernels run: there is no forward pass), gloo is the
backend, a hybrid linear-attention model (Qwen3-Next) takes the CPU-legal scheduler settings of the planning
context (`loopback.server_args.cpu_rank_settings`: they size caches and order batches, never weights), and
`verl_p2p.sandbox.cpu_stubs.install_cpu_stubs()` supplies the `vllm._custom_ops` module SGLang's rotary embedding
imports on hosts without CUDA.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch

from verl_p2p.errors import P2PConfigError
from verl_p2p.loopback.server_args import cpu_rank_settings, server_args_field_names
from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs


def _generation() -> str:
    """How the installed SGLang sets a rank up, found from what it offers (not from its version string):
    "runtime_context" where the launcher places ranks through `publish(..., ranks=SpawnRanks(...))` (0.5.21
    on), else "module_globals" (parallel groups are module globals; from 0.5.14 part of the rest lives in the
    process-wide runtime context, which SGLang's own initializers fill)."""
    import importlib.util
    import inspect

    if importlib.util.find_spec("sglang.srt.runtime_context") is None:
        return "module_globals"
    import sglang.srt.runtime_context as rc

    publish = getattr(rc, "publish", None)
    if hasattr(rc, "SpawnRanks") and publish is not None and "ranks" in inspect.signature(publish).parameters:
        return "runtime_context"
    return "module_globals"


def _call(fn, *args, **keywords):
    """Call an SGLang function with the keyword arguments its signature in this release accepts."""
    import inspect

    accepted = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in keywords.items() if k in accepted})


def _args(model_path: str, server_args: Mapping[str, Any], tp_size: int) -> dict:
    args = dict(server_args)
    for key in ("model_path", "tokenizer_path"):
        args.pop(key, None)
    if int(args.setdefault("tp_size", tp_size)) != tp_size:
        raise P2PConfigError(f"server_args tp_size={args['tp_size']} but {tp_size} rank processes were started")
    args["device"] = "cpu"
    args.setdefault("dtype", "auto")
    return {"model_path": model_path, **args}


def _server_args(model_path: str, server_args: Mapping[str, Any], tp_size: int):
    from sglang.srt.server_args import ServerArgs

    args = _args(model_path, server_args, tp_size)
    known = server_args_field_names()
    for key, value in cpu_rank_settings(model_path, known).items():
        args.setdefault(key, value)
    unknown = sorted(set(args) - known)
    if unknown:
        import sglang

        raise P2PConfigError(f"unknown SGLang server args {unknown} (SGLang {sglang.__version__})")
    record = ServerArgs(**args)
    if hasattr(record, "resolve_once"):
        record.resolve_once()
    return record


def sglang_server_info(model_path: str, server_args: Mapping[str, Any]) -> dict:
    """The resolved server args SGLang would serve at `/server_info` for this configuration (CPU stand-in)."""
    install_cpu_stubs()
    tp_size = int(server_args.get("tp_size", 1))
    return _server_info(_server_args(model_path, server_args, tp_size))


def _server_info(record) -> dict:
    import sglang

    info = record.resolved_dict() if hasattr(record, "resolved_dict") else dataclasses.asdict(record)
    return {**info, "version": sglang.__version__}


def _load(model_config, record, tp_rank: int) -> torch.nn.Module:
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader import get_model

    load_config = LoadConfig(
        load_format=record.load_format,
        download_dir=record.download_dir,
        model_loader_extra_config=record.model_loader_extra_config,
        tp_rank=tp_rank,
    )
    return get_model(model_config=model_config, load_config=load_config, device_config=DeviceConfig("cpu", tp_rank))


def _build_module_globals(record, tp_rank: int, tp_size: int, dist_init_method: str) -> torch.nn.Module:
    import sglang.srt.eplb.expert_location as expert_location
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(record)
    _call(initialize_moe_config, server_args=record)
    model_config = ModelConfig.from_server_args(record)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.set_custom_all_reduce(not record.disable_custom_all_reduce)
    ps.init_distributed_environment(
        backend="gloo",
        world_size=tp_size,
        rank=tp_rank,
        local_rank=tp_rank,
        distributed_init_method=dist_init_method,
        timeout=record.dist_timeout,
    )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp_size,
        expert_model_parallel_size=record.ep_size,
        pipeline_model_parallel_size=record.pp_size,
        attention_data_parallel_size=record.dp_size if record.enable_dp_attention else 1,
        attention_context_model_parallel_size=record.attn_cp_size,
        moe_data_model_parallel_size=record.moe_dp_size,
    )
    initialize_dp_attention(server_args=record, model_config=model_config)
    expert_location._global_expert_location_metadata = None
    _call(
        expert_location.set_global_expert_location_metadata,
        _call(
            expert_location.compute_initial_expert_location_metadata,
            server_args=record,
            model_config=model_config,
            moe_ep_rank=ps.get_moe_expert_parallel_rank(),
        ),
        allow_overwrite=True,
    )
    return _load(model_config, record, tp_rank)


def _build_runtime_context(record, tp_rank: int, tp_size: int, dist_init_method: str) -> torch.nn.Module:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.eplb.expert_location import (
        compute_initial_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.layers.dp_attention import init_dp_gathered_buffer, initialize_dp_attention
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    publish(record, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank, gpu_id=tp_rank))
    initialize_moe_config()
    model_config = ModelConfig.from_server_args(record)
    ps.set_custom_all_reduce(not record.disable_custom_all_reduce)
    ps.init_distributed_environment(
        backend="gloo",
        world_size=tp_size,
        rank=tp_rank,
        local_rank=tp_rank,
        distributed_init_method=dist_init_method,
        timeout=get_parallel().dist_timeout,
    )
    ps.initialize_model_parallel()
    initialize_dp_attention(record)
    init_dp_gathered_buffer(model_config)
    set_global_expert_location_metadata(
        compute_initial_expert_location_metadata(model_config=model_config, moe_ep_rank=get_parallel().moe_ep_rank),
        allow_overwrite=True,
    )
    return _load(model_config, record, tp_rank)


def build_sglang_rank_model(
    model_path: str, server_args: dict, tp_rank: int, tp_size: int, dist_init_method: str
) -> torch.nn.Module:
    """Rank `tp_rank` of `tp_size`: SGLang's model class loaded from `model_path` by SGLang's loader (CPU).

    `server_args` holds SGLang ServerArgs fields (tp_size, ep_size, dp_size, enable_dp_attention, dtype, ...).
    May be called again in the same process for another model or layout of the same world size. The
    resolved server args (what `/server_info` would serve) are attached as `model.sglang_server_info`.
    """
    install_cpu_stubs()
    if not torch.cuda.is_available():
        # CPU stand-in: the CUDA torch wheel ships libnccl, which SGLang's groups would try to use on a
        # device-less host; pointing SGLang's NCCL path at nothing disables PyNccl (gloo does the work).
        os.environ.setdefault("SGLANG_NCCL_SO_PATH", "verl-p2p-cpu-host-has-no-nccl")
    if not 0 <= tp_rank < tp_size:
        raise P2PConfigError(f"tp_rank={tp_rank} is outside tp_size={tp_size}")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() != tp_size:
        raise P2PConfigError(
            f"this process already joined a world of {torch.distributed.get_world_size()} ranks, not {tp_size}"
        )
    generation = _generation()
    record = _server_args(model_path, server_args, tp_size)
    build = _build_module_globals if generation == "module_globals" else _build_runtime_context
    model = build(record, tp_rank, tp_size, dist_init_method)
    model.sglang_server_info = _server_info(record)
    return model

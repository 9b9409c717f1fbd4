"""The loopback engine's server args: a real `sglang.srt.server_args.ServerArgs`, as `/server_info` reports it.

`launch_server_args` gives the ServerArgs fields an engine is launched with (what the rank processes get);
`resolve_server_args` constructs the installed SGLang's ServerArgs from them and returns its fields after
SGLang's own resolution (0.5.12: the dataclass fields; 0.5.23: `resolved_dict()`).

Two honest work-arounds for a CPU host: `device="cuda"` is stated explicitly (SGLang's device auto-detection
raises without an accelerator, and the loopback stands in for a GPU server, so it reports what that server
would; the rank processes build with device "cpu"); and the environment variables ServerArgs sets for
SGLang's own server process are restored afterwards, so the caller's environment is left alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any


def server_args_field_names() -> set[str]:
    """The installed SGLang's ServerArgs field names."""
    from sglang.srt.server_args import ServerArgs

    try:
        from sglang.srt.arg_groups.arg_utils import record_fields
    except ImportError:
        return {f.name for f in dataclasses.fields(ServerArgs)}
    return {f.name for f in record_fields(ServerArgs)}


def cpu_rank_settings(model_path: str | os.PathLike, fields: set[str]) -> dict[str, Any]:
    """Scheduler settings a CPU rank of this model takes instead of GPU defaults SGLang refuses on a CPU host:
    for hybrid linear attention (Qwen3-Next) the planning context's own (`rank_context.HYBRID_CPU_SETTINGS`),
    which size caches and order batches, never weights. Only those the installed ServerArgs has."""
    from verl_p2p.replica.rank_context import HYBRID_CPU_SETTINGS, hybrid_linear_attention

    config = Path(model_path) / "config.json"
    if not config.is_file() or not hybrid_linear_attention(json.loads(config.read_text())):
        return {}
    return {k: v for k, v in HYBRID_CPU_SETTINGS.items() if k in fields}


def launch_server_args(
    model_path: str,
    *,
    tp: int,
    ep: int = 1,
    dp_attention: int = 1,
    dtype: str = "float32",
    host: str = "127.0.0.1",
    port: int = 30000,
    bootstrap_port: int = 6789,
    api_key: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """ServerArgs fields of an engine with this layout and the launch settings p2p needs."""
    kwargs: dict[str, Any] = dict(
        model_path=str(model_path),
        tp_size=tp,
        ep_size=ep,
        dp_size=dp_attention,
        enable_dp_attention=dp_attention > 1,
        dtype=dtype,
        device="cuda",
        host=host,
        port=port,
        api_key=api_key,
        remote_instance_weight_loader_start_seed_via_transfer_engine=True,
        engine_info_bootstrap_port=bootstrap_port,
        enable_memory_saver=False,
    )
    kwargs.update(overrides)
    return kwargs


def resolve_server_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every field of the installed SGLang's ServerArgs built from `kwargs`, JSON-ready, after resolution."""
    from sglang.srt.server_args import ServerArgs

    saved = dict(os.environ)
    try:
        record = ServerArgs(**kwargs)
        if dataclasses.is_dataclass(record):
            return dataclasses.asdict(record)
        record.resolve_once()
        return record.resolved_dict()
    finally:
        os.environ.clear()
        os.environ.update(saved)

"""Per-release adapters that install one rollout rank's SGLang state, and the server-args record they hand SGLang.

Where SGLang keeps a rank's state depends on the release; `RankContext` (rank_context.py) picks the adapter by what
the installed SGLang offers. Where the parallel groups are module globals (0.5.12 .. 0.5.20), `_GlobalsAdapter`
runs SGLang's own initializers once per rank and swaps the globals they set in and out (from 0.5.14 together with a
fresh `runtime_context` per rank). Where the runtime context places ranks itself (0.5.21 on),
`_RuntimeContextAdapter` keeps one context per rank. Neither is thread-safe: every use holds `RANK_STATE_LOCK`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import dis
import importlib
import importlib.util
import inspect
import threading
from collections.abc import Mapping
from typing import Any

from verl_p2p.errors import UnsupportedLayoutError
from verl_p2p.replica.rank_groups import stand_in_groups

# One lock for every rank-state change in this process (re-entrant: a rank context built inside another's `with`).
RANK_STATE_LOCK = threading.RLock()
_LOCK = RANK_STATE_LOCK

# Server-args fields that name one engine instance (ports, hosts, paths, logs), not the bytes it holds.
INSTANCE_FIELDS = frozenset(
    {
        "model_path",
        "tokenizer_path",
        "host",
        "port",
        "nccl_port",
        "dist_init_addr",
        "engine_info_bootstrap_port",
        "disaggregation_bootstrap_port",
        "base_gpu_id",
        "gpu_id_step",
        "node_rank",
        "served_model_name",
        "api_key",
        "admin_api_key",
        "random_seed",
        "log_level",
        "log_level_http",
        "log_requests",
        "log_requests_level",
        "enable_metrics",
        "file_storage_path",
        "crash_dump_folder",
        "version",
        "weight_version",
        "download_dir",
        "decrypted_config_file",
        "decrypted_draft_config_file",
        "remote_instance_weight_loader_seed_instance_ip",
        "remote_instance_weight_loader_seed_instance_service_port",
        "remote_instance_weight_loader_send_weights_group_ports",
    }
)


def _sglang_field_values(server_args: Mapping[str, Any], names: set[str]) -> dict:
    """The ServerArgs fields of the installed release found in `server_args`, instance fields left out."""
    return {k: v for k, v in server_args.items() if k in names and k not in INSTANCE_FIELDS}


def _with_config_dir(values: dict, names: set[str], config_dir: str) -> dict:
    values = dict(values, model_path=config_dir)
    if "tokenizer_path" in names:
        values["tokenizer_path"] = config_dir
    return values


# Scheduler settings of hybrid linear-attention models (Qwen3-Next) that SGLang refuses on a CPU host: the Mamba
# cache's `extra_buffer` needs a GPU platform and `no_buffer` no overlap schedule. They size caches and order
# batches, not weights: the planning context takes the CPU-legal values (and so do the CPU loopback ranks).
HYBRID_CPU_SETTINGS = {"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True}


def hybrid_linear_attention(cfg: Mapping[str, Any]) -> bool:
    """A model whose layers mix linear (gated-delta-net / Mamba) and full attention."""
    return "linear_attention" in (cfg.get("layer_types") or ()) or "full_attention_interval" in cfg


def _planning_values(values: dict, names: set[str], ctx: Any) -> dict:
    """The rollout's server args as the planning context hands them to SGLang on this host."""
    values = _with_config_dir(values, names, ctx.config_dir)
    if getattr(ctx, "hybrid_linear_attention", False):
        values.update({k: v for k, v in HYBRID_CPU_SETTINGS.items() if k in names})
    return values


class _ModuleState:
    """Saves, installs and restores named globals of SGLang modules."""

    def __init__(self, modules: list):
        self.modules = modules
        self.ours: list[dict] = [{} for _ in modules]
        self._saved: list[dict] | None = None

    def capture(self, run, initializers) -> None:
        """Run SGLang's own initializers once; keep every global they assign as this rank's value."""
        assigned: dict[str, set[str]] = {}
        for f in initializers:
            stores = {i.argval for i in dis.get_instructions(f) if i.opname == "STORE_GLOBAL"}
            assigned.setdefault(f.__module__, set()).update(stores)
        before = [dict(vars(m)) for m in self.modules]
        try:
            run()
            for i, m in enumerate(self.modules):
                now = vars(m)
                changed = {k for k in now if k not in before[i] or now[k] is not before[i][k]}
                own = {k for k in assigned.get(m.__name__, ()) if k in now}
                self.ours[i].update({k: now[k] for k in changed | own})
        finally:
            self._restore(before)

    def set(self, module, name: str, value: Any) -> None:
        self.ours[self.modules.index(module)][name] = value

    def activate(self) -> None:
        self._saved = [{k: vars(m).get(k, _MISSING) for k in self.ours[i]} for i, m in enumerate(self.modules)]
        for i, m in enumerate(self.modules):
            for k, v in self.ours[i].items():
                setattr(m, k, v)

    def deactivate(self) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
            self._restore(saved)

    def _restore(self, saved: list[dict]) -> None:
        for i, m in enumerate(self.modules):
            for k, v in saved[i].items():
                if v is _MISSING:
                    vars(m).pop(k, None)
                else:
                    setattr(m, k, v)


_MISSING = object()


def _call(fn, *args, **keywords):
    """Call an SGLang function with the keyword arguments its signature in this release accepts."""
    accepted = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in keywords.items() if k in accepted})


def _optional_module(name: str):
    return importlib.import_module(name) if importlib.util.find_spec(name) is not None else None


class _GlobalsAdapter:
    """SGLang releases whose parallel groups are module globals (0.5.12 .. 0.5.20): groups, DP-attention
    ranks, MoE config, server args and expert map are globals, or (from 0.5.14) partly state of the
    process-wide `runtime_context`, which then gets a fresh context of its own per rank, swapped in with the
    globals. SGLang's own initializers run once, called with the arguments their signature takes here."""

    def __init__(self, ctx: Any):  # the RankContext being built
        import sglang.srt.distributed.parallel_state as ps
        import sglang.srt.eplb.expert_location as el
        import sglang.srt.layers.dp_attention as dpa
        import sglang.srt.layers.moe.utils as moe_utils
        import sglang.srt.server_args as sa_mod
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.server_args import ServerArgs

        rc = _optional_module("sglang.srt.runtime_context")
        layout = ctx.layout
        self.fields_used, record = _server_args_record(ServerArgs, ctx)
        self.server_args = record
        self.state = _ModuleState([ps, dpa, moe_utils, sa_mod, el] + ([rc] if rc is not None else []))
        groups = stand_in_groups(layout)
        for name, attr in (
            ("world", "_WORLD"),
            ("tp", "_TP"),
            ("pp", "_PP"),
            ("attn_tp", "_ATTN_TP"),
            ("attn_cp", "_ATTN_CP"),
            ("moe_dp", "_MOE_DP"),
            ("moe_tp", "_MOE_TP"),
            ("moe_ep", "_MOE_EP"),
        ):
            self.state.set(ps, attr, groups[name])
        self.state.set(ps, "_ENABLE_PDMUX_P_TP", False)
        self.state.set(el, "_global_expert_location_metadata", None)
        if rc is not None:  # flags, resources and published config of this rank live in its own context
            context = rc.RuntimeContext(parallel=rc.ParallelContext())
            self.state.set(rc, "_CONTEXT", context)
            self.state.set(rc, "_PARALLEL", context.parallel)
        built: dict[str, Any] = {}

        def init() -> None:
            sa_mod.set_global_server_args_for_scheduler(record)  # from 0.5.17 it publishes into the context
            built["model_config"] = model_config = ModelConfig.from_server_args(record)
            _call(initialize_moe_config, server_args=record)
            dpa.initialize_dp_attention(record, model_config)
            compute = el.compute_initial_expert_location_metadata
            if "server_args" in inspect.signature(compute).parameters:  # up to 0.5.18: the record says the device
                on_cpu = copy.copy(record)
                on_cpu.device = "cpu"
                metadata = compute(on_cpu, model_config, layout.moe_ep_rank)
            else:  # the resolved record is read-only; the context's device bag says it
                with rc.get_device().override(device="cpu"):
                    metadata = compute(model_config=model_config, moe_ep_rank=layout.moe_ep_rank)
            _call(el.set_global_expert_location_metadata, metadata, allow_overwrite=True)

        initializers = (
            sa_mod.set_global_server_args_for_scheduler,
            initialize_moe_config,
            dpa.initialize_dp_attention,
            el.set_global_expert_location_metadata,
        )
        self.state.activate()
        try:
            self.state.capture(init, initializers)
        finally:
            self.state.deactivate()
        self.model_config = built["model_config"]

    def activate(self) -> None:
        self.state.activate()

    def deactivate(self) -> None:
        self.state.deactivate()


def _server_args_record(ServerArgs, ctx: Any) -> tuple[dict, Any]:
    """The rollout's ServerArgs as this release's record, and the fields of it taken from `/server_info`.

    A dataclass ServerArgs (up to 0.5.19) is filled without re-running `__post_init__`: `/server_info`
    carries resolved values. A declared one (0.5.20 on) takes them as raw input and resolves when published.
    """
    if not dataclasses.is_dataclass(ServerArgs):
        from sglang.srt.arg_groups.arg_utils import record_fields

        names = {f.name for f in record_fields(ServerArgs)}
        used = _sglang_field_values(ctx.server_args_in, names)
        return used, ServerArgs(**_planning_values(used, names, ctx))
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    record = object.__new__(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = None
        setattr(record, f.name, value)
    used = _sglang_field_values(ctx.server_args_in, names)
    for k, v in _planning_values(used, names, ctx).items():
        setattr(record, k, v)
    if record.device is None:
        record.device = "cuda"
    return used, record


@contextlib.contextmanager
def _swapped_in(rc, context):
    """Make `context` the process's runtime context while inside (what `use_context` does where it exists)."""
    previous = rc._CONTEXT, rc._PARALLEL
    rc._CONTEXT, rc._PARALLEL = context, context.parallel
    try:
        yield context
    finally:
        rc._CONTEXT, rc._PARALLEL = previous


def _new_rank_context(rc, record, ranks):
    """A runtime context of its own for one rank, and the function that activates it.

    Releases with `create_context`/`use_context` (0.5.22 on) build one directly. Before that (0.5.21),
    `publish` configures the process-wide context in place, so it gets a fresh one swapped in to configure.
    """
    if hasattr(rc, "create_context") and hasattr(rc, "use_context"):
        return rc.create_context(record, role="scheduler", ranks=ranks), rc.use_context
    context = rc.RuntimeContext(parallel=rc.ParallelContext())
    with _swapped_in(rc, context):
        rc.publish(record, role="scheduler", ranks=ranks)
    return context, lambda c: _swapped_in(rc, c)


class _RuntimeContextAdapter:
    """SGLang 0.5.21 on: one `RuntimeContext` per rank, groups stamped on its parallel state."""

    def __init__(self, ctx: Any):  # the RankContext being built
        import sglang.srt.runtime_context as rc
        from sglang.srt.arg_groups.arg_utils import record_fields
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.eplb.expert_location import (
            compute_initial_expert_location_metadata,
            set_global_expert_location_metadata,
        )
        from sglang.srt.layers.dp_attention import init_dp_gathered_buffer, initialize_dp_attention
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.runtime_context import SpawnRanks, get_device, get_parallel
        from sglang.srt.server_args import ServerArgs

        layout = ctx.layout
        names = {f.name for f in record_fields(ServerArgs)}
        self.fields_used = _sglang_field_values(ctx.server_args_in, names)
        # Raw input, as the CLI would give it (nested configs as dicts); the context resolves it.
        record = ServerArgs(**_planning_values(self.fields_used, names, ctx))
        self.server_args = record
        with _LOCK:
            self.context, self._use_context = _new_rank_context(rc, record, SpawnRanks(world_rank=layout.tp_rank))
        use_context = self._use_context
        groups = stand_in_groups(layout)
        stamped = {f"{name}_group": g for name, g in groups.items()}
        with use_context(self.context):
            parallel = get_parallel()
            shared_tp = getattr(parallel, "shared_experts_tp_size", None)
            if shared_tp is not None and shared_tp > 1:
                raise UnsupportedLayoutError(
                    f"shared_experts_tp_size={shared_tp} is not supported by the replica; leave it unset"
                )
            if parallel.attn_dcp_size > 1:
                raise UnsupportedLayoutError("decode context parallelism (dcp_size > 1) is not supported")
            parallel.override_permanently(**stamped)
            self.model_config = ModelConfig.from_server_args(record)
            initialize_moe_config()
            initialize_dp_attention(record)
            init_dp_gathered_buffer(self.model_config)
            with get_device().override(device="cpu"):
                metadata = compute_initial_expert_location_metadata(
                    model_config=self.model_config, moe_ep_rank=layout.moe_ep_rank
                )
            set_global_expert_location_metadata(metadata, allow_overwrite=True)
            placed = {
                "tp_rank": parallel.tp_rank,
                "attn_tp_rank": parallel.attn_tp_rank,
                "attn_dp_rank": parallel.attn_dp_rank,
                "moe_ep_rank": parallel.moe_ep_rank,
                "moe_tp_rank": parallel.moe_tp_rank,
            }
        expected = {k: getattr(layout, k) for k in placed}
        if placed != expected:
            raise UnsupportedLayoutError(
                f"SGLang {ctx.version} places rank {layout.tp_rank} at {placed}, the p2p layout says {expected}: "
                "the layout arithmetic in verl_p2p/planning/layout.py no longer matches this SGLang release"
            )
        self._active = None

    def activate(self) -> None:
        self._active = self._use_context(self.context)
        self._active.__enter__()

    def deactivate(self) -> None:
        active, self._active = self._active, None
        if active is not None:
            active.__exit__(None, None, None)

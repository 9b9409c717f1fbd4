"""Be "TP rank r of this rollout layout" inside one process, without a distributed world.

SGLang's model classes and weight loaders ask the parallel state who they are (tp rank, attention-TP rank,
expert-parallel rank, ...), read the global server args, the MoE backend config, the DP-attention flags
and the expert-location map. A `RankContext` prepares all of that for one rank of one layout and installs
it while entered, so SGLang builds and loads exactly the shard that rank holds. The group objects are
stand-ins (`StandInGroup`): they answer every question about membership and refuse communication.

Where that state lives depends on the release, and the adapter is chosen by what the installed SGLang offers
(`RankStateFeatures`), not by its version string. Where the parallel groups are module globals (0.5.12 ..
0.5.20), `_GlobalsAdapter` runs SGLang's own initializers once per rank and swaps the globals they set in
and out; from 0.5.14 part of that state (flags, resources, published config) lives in the process-wide
`runtime_context`, which then gets a fresh context per rank, swapped in with the globals. Where the runtime
context places ranks itself (`publish(..., ranks=SpawnRanks)`, 0.5.21 on), `_RuntimeContextAdapter` keeps
one context per rank (`create_context`/`use_context` where they exist, else a fresh context swapped in
around `publish`). Initializers are called with the arguments their signature in the installed release
takes. Releases outside `TESTED_SGLANG_RANGE` are refused with the range. Neither adapter is thread-safe, so
every entry takes one module lock (re-entrant).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import dis
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import stat
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import torch

from verl_p2p.environment import environment_set  # noqa: F401 - also imported from here (tests/support)
from verl_p2p.errors import UnsupportedLayoutError
from verl_p2p.planning.layout import RankLayout, check_reproducible, layout_from_server_args

_LOCK = threading.RLock()
logger = logging.getLogger(__name__)

# The SGLang releases the replica supports, both ends included (the `sglang` extra of pyproject.toml says the
# same). CI runs the replica-exact matrix on 0.5.12, 0.5.21 and 0.5.23 (tests/test_replica_exact.py).
TESTED_SGLANG_RANGE = ("0.5.12", "0.5.23")

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


class UnsupportedSGLangVersionError(UnsupportedLayoutError):
    """The installed SGLang release has no rank-context adapter here."""


class StandInGroup:
    """Stand-in for SGLang's `GroupCoordinator`: membership answers, no communication.

    One fresh object per group per rank context; never mutated after construction.
    """

    def __init__(self, name: str, ranks: list[int], rank: int):
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a member of group {name} {ranks}")
        self.unique_name = f"verl_p2p_stand_in:{name}"
        self.group_name = name
        self.ranks = list(ranks)
        self.rank = rank
        self.local_rank = rank
        self.world_size = len(ranks)
        self.rank_in_group = self.ranks.index(rank)
        self.first_rank = self.ranks[0]
        self.last_rank = self.ranks[-1]
        self.is_first_rank = rank == self.first_rank
        self.is_last_rank = rank == self.last_rank
        self.next_rank = self.ranks[(self.rank_in_group + 1) % self.world_size]
        self.prev_rank = self.ranks[(self.rank_in_group - 1) % self.world_size]
        self.device = torch.device("cpu")
        self.local_size = self.world_size
        self.cpu_group = None
        self.device_group = None
        for flag in ("use_pynccl", "use_pymscclpp", "use_custom_allreduce", "use_torch_symm_mem_all_reduce"):
            setattr(self, flag, False)
        for comm in ("pynccl_comm", "pymscclpp_comm", "ca_comm", "qr_comm", "torch_symm_mem_comm", "mq_broadcaster"):
            setattr(self, comm, None)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{self.unique_name} (verl_p2p rank-context stand-in) has no {name!r}: the replica builds and loads "
            "weights without communication; if this SGLang release needs it there, extend StandInGroup"
        )

    def __repr__(self) -> str:
        return f"StandInGroup({self.group_name}, ranks={self.ranks}, rank={self.rank})"


def group_ranks(layout: RankLayout) -> dict[str, list[int]]:
    """The global ranks of every parallel group rank `layout.tp_rank` belongs to (rollout PP is 1)."""
    r, t = layout.tp_rank, layout.tp_size
    attn_start = layout.attn_dp_rank * layout.attn_tp_size
    moe_tp_start = layout.moe_ep_rank * layout.moe_tp_size
    return {
        "world": list(range(t)),
        "tp": list(range(t)),
        "pp": [r],
        "attn_tp": list(range(attn_start, attn_start + layout.attn_tp_size)),
        "attn_cp": [r],
        "moe_dp": [r],
        "moe_tp": list(range(moe_tp_start, moe_tp_start + layout.moe_tp_size)),
        "moe_ep": [layout.moe_tp_rank + k * layout.moe_tp_size for k in range(layout.ep_size)],
    }


def stand_in_groups(layout: RankLayout) -> dict[str, StandInGroup]:
    """A fresh set of stand-in groups for one rank; like SGLang, a group spanning the TP group *is* it."""
    ranks = group_ranks(layout)
    groups = {"world": StandInGroup("world", ranks["world"], layout.tp_rank)}
    groups["tp"] = StandInGroup("tp", ranks["tp"], layout.tp_rank)
    for name, members in ranks.items():
        if name not in groups:
            same = members == ranks["tp"] and name != "pp"
            groups[name] = groups["tp"] if same else StandInGroup(name, members, layout.tp_rank)
    return groups


def sglang_version() -> str:
    import sglang

    return str(sglang.__version__)


def base_version(version: str) -> str:
    """'0.5.12' from '0.5.12', '0.5.12.post1' or '0.5.12+local'."""
    return ".".join(re.split(r"[+]", str(version))[0].split(".")[:3])


def release_id(version: str) -> str:
    """The full release, normalized ('0.5.12.post1', '0.5.12+cu128' stay apart from '0.5.12'): post releases and
    local builds may load weights differently, so only equal release ids share plans and replicas."""
    text = str(version).strip()
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - packaging comes with torch and transformers
        return text
    try:
        return str(Version(text))
    except InvalidVersion:
        return text


def _release(version: str) -> tuple[int, ...] | None:
    match = re.match(r"^\s*(\d+)\.(\d+)\.(\d+)", str(version))
    return tuple(int(x) for x in match.groups()) if match else None


def check_tested_range(version: str) -> None:
    """Refuse an SGLang release outside TESTED_SGLANG_RANGE, naming the range and the fix."""
    low, high = TESTED_SGLANG_RANGE
    release = _release(version)
    if release is None or not _release(low) <= release <= _release(high):
        raise UnsupportedSGLangVersionError(
            f"SGLang {version} is outside the range the p2p replica supports and is tested on ({low} .. {high}); "
            f"install a release in that range on the trainer (pip install 'sglang>={low},<={high}'), the same "
            "release the rollout servers run"
        )


@dataclasses.dataclass(frozen=True)
class RankStateFeatures:
    """Where the installed SGLang keeps the state that makes a process "rank r" (found by inspection)."""

    runtime_context: bool  # sglang.srt.runtime_context exists (else: module globals only)
    context_placement: bool  # publish(..., ranks=SpawnRanks) places the ranks, override_permanently stamps groups
    model_contexts: bool  # create_context + use_context (else: publish into a fresh context swapped in)
    record_fields: bool  # ServerArgs fields via arg_groups.arg_utils.record_fields (else dataclasses.fields)

    @classmethod
    def detect(cls) -> RankStateFeatures:
        if importlib.util.find_spec("sglang.srt.runtime_context") is None:
            return cls(False, False, False, False)
        import sglang.srt.runtime_context as rc

        publish = getattr(rc, "publish", None)
        placement = (
            hasattr(rc, "SpawnRanks")
            and hasattr(getattr(rc, "ParallelContext", None), "override_permanently")
            and publish is not None
            and "ranks" in inspect.signature(publish).parameters
        )
        return cls(
            runtime_context=True,
            context_placement=placement,
            model_contexts=hasattr(rc, "create_context") and hasattr(rc, "use_context"),
            record_fields=importlib.util.find_spec("sglang.srt.arg_groups.arg_utils") is not None,
        )

    def adapter_kind(self, version: str) -> str:
        """`runtime_context` where the context places ranks itself (0.5.21 on), else `module_globals`."""
        if self.runtime_context and self.context_placement:
            if not self.record_fields:
                raise UnsupportedSGLangVersionError(
                    f"SGLang {version} places ranks in its runtime context but has no "
                    "sglang.srt.arg_groups.arg_utils.record_fields to read its ServerArgs fields; the p2p replica "
                    f"supports {' .. '.join(TESTED_SGLANG_RANGE)}"
                )
            return "runtime_context"
        return "module_globals"


def _adapter_kind(version: str) -> str:
    check_tested_range(version)
    return RankStateFeatures.detect().adapter_kind(version)


def hf_config_dict(hf_config: Any) -> dict:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    to_dict = getattr(hf_config, "to_dict", None)
    if to_dict is None:
        raise TypeError(f"hf_config must be a dict or a transformers PretrainedConfig, got {type(hf_config)}")
    return to_dict()


@functools.cache
def _private_config_base() -> str:
    """This user's own directory for config copies: `<tmp>/verl_p2p_cfg-<uid>`, mode 0700, owned by this user.

    A shared temporary directory lets anyone create that name first (or a symlink of it); such a directory
    (not ours, not private, not a directory) is never used: a fresh `mkdtemp` directory serves this process.
    Chosen once per process (`functools.cache`): every config copy of a process goes to one directory, and a
    fallback `mkdtemp` directory is made at most once.
    """
    uid = os.getuid()
    base = os.path.join(tempfile.gettempdir(), f"verl_p2p_cfg-{uid}")
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        fresh = tempfile.mkdtemp(prefix="verl_p2p_cfg-")
        logger.warning(
            "p2p replica: %s is not a private directory of this user (owner uid %d, mode %o); writing rollout "
            "configs to %s instead. Remove %s if nobody else should own it",
            base,
            st.st_uid,
            stat.S_IMODE(st.st_mode),
            fresh,
            base,
        )
        base = fresh
    return base


def checkpoint_config_dir(hf_config: Any) -> str:
    """A directory holding only `config.json` of `hf_config` (SGLang's ModelConfig reads configs from a path).

    One directory per config digest inside this user's private directory (`_private_config_base`), so a killed
    process (Ray actors are) leaks nothing and no other user can plant a config (or code, with
    `trust_remote_code`) there. The file is checked against the config on every use and rewritten atomically
    when it differs, so concurrent writers never expose a half-written config.
    """
    text = json.dumps(hf_config_dict(hf_config), sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    with _LOCK:
        path = os.path.join(_private_config_base(), digest)
        target = os.path.join(path, "config.json")
        os.makedirs(path, mode=0o700, exist_ok=True)
        try:
            with open(target) as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            fd, partial = tempfile.mkstemp(dir=path, prefix=".config.", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(partial, target)
    return path


def rollout_environment(server_args: Mapping[str, Any]) -> dict[str, bool]:
    """The rollout's environment settings that decide its bytes, as p2p carries them in server args (read from
    published sizes, `planning.shared_experts`): {} when none is set, so other plans keep their digests."""
    from verl_p2p.planning.shared_experts import SHARED_TP1

    return {SHARED_TP1: True} if server_args.get(SHARED_TP1) is True else {}


def _rollout_environment_set(settings: Mapping[str, bool]):
    """SGLang reads these from the process environment when it builds a model: each set to the rollout's value
    (never the trainer's own environment) while inside."""
    from verl_p2p.planning.shared_experts import SHARED_TP1

    return environment_set({SHARED_TP1: "1" if settings.get(SHARED_TP1) else "0"})


def server_args_fingerprint(server_args: Mapping[str, Any]) -> str:
    """Digest of the server args that decide a rank's bytes (instance fields such as ports left out)."""
    relevant = {k: v for k, v in server_args.items() if k not in INSTANCE_FIELDS}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()


def _check_model_level(server_args: Mapping[str, Any], hf: dict) -> None:
    from verl_p2p.replica.fp8 import quantization_problems

    problems = quantization_problems(server_args, hf)
    backend = str(server_args.get("moe_runner_backend") or "auto")
    if backend.startswith("flashinfer_trtllm") or backend == "flashinfer_mxfp4":
        problems.append(
            f"moe_runner_backend={backend!r} reorders expert weights after loading on the GPU; use 'auto' or 'triton'"
        )
    a2a = str(server_args.get("moe_a2a_backend") or "none")
    if a2a not in ("none", "None"):
        problems.append(f"moe_a2a_backend={a2a!r} is not supported by the replica; use 'none'")
    if server_args.get("enable_lora"):
        problems.append("LoRA adapters are not supported; turn enable_lora off")
    if problems:
        raise UnsupportedLayoutError("p2p replica cannot reproduce this rollout: " + "; ".join(problems))


def installed_sglang_version() -> str:
    """The SGLang release this process would import, without importing it when it is not loaded yet."""
    import sys

    module = sys.modules.get("sglang")
    if module is not None:
        return str(module.__version__)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return sglang_version()


def preflight(server_args: Mapping[str, Any], layout: RankLayout, hf_config: Any, version: str) -> None:
    """The checks a rank context makes before touching SGLang: layout, release and model-level settings."""
    check_reproducible(server_args)
    derived = layout_from_server_args(server_args, layout.tp_rank)
    if derived != layout:
        raise UnsupportedLayoutError(
            f"rank layout {layout} disagrees with the one its server args give ({derived}); "
            "pass the layout derived from the same /server_info"
        )
    check_tested_range(version)  # which adapter fits is decided when SGLang is first needed (RankContext)
    served = server_args.get("version")
    if served and release_id(served) != release_id(version):
        raise UnsupportedLayoutError(
            f"the rollout runs SGLang {served}, this trainer has SGLang {version}: the replica reproduces "
            "the bytes of its own release only (post releases and local builds included); install the rollout's "
            f"SGLang release on the trainer (pip install 'sglang=={served}')"
        )
    _check_model_level(server_args, hf_config_dict(hf_config))


def server_args_field_names(version: str) -> frozenset[str]:
    """The ServerArgs fields of the installed SGLang release (imports SGLang)."""
    from sglang.srt.server_args import ServerArgs

    if _adapter_kind(version) == "runtime_context":
        from sglang.srt.arg_groups.arg_utils import record_fields

        return frozenset(f.name for f in record_fields(ServerArgs))
    return frozenset(f.name for f in dataclasses.fields(ServerArgs))


def plan_fingerprint(server_args: Mapping[str, Any], field_names: frozenset[str] | set[str]) -> str:
    """Digest of the server args a rank context hands SGLang (its ServerArgs fields, instance fields left out)."""
    return server_args_fingerprint(
        {**_sglang_field_values(server_args, set(field_names)), **rollout_environment(server_args)}
    )


class RankContext:
    """SGLang's rank state for one rollout rank; `with ctx:` installs it (serialized, re-entrant)."""

    def __init__(self, server_args: Mapping[str, Any], layout: RankLayout, hf_config: Any):
        self.version = sglang_version()
        preflight(server_args, layout, hf_config, self.version)
        kind = _adapter_kind(self.version)
        self.layout = layout
        self.server_args_in = dict(server_args)
        self.config_dir = checkpoint_config_dir(hf_config_dict(hf_config))
        self.hybrid_linear_attention = hybrid_linear_attention(hf_config_dict(hf_config))
        self.environment = rollout_environment(server_args)
        self._installed = contextlib.ExitStack()  # what activation set, undone when the outermost `with` exits
        self._depth = 0
        with _LOCK:
            self._adapter = _GlobalsAdapter(self) if kind == "module_globals" else _RuntimeContextAdapter(self)
        self.server_args = self._adapter.server_args
        self.model_config = self._adapter.model_config

    @property
    def fingerprint(self) -> str:
        """Digest of the server args handed to SGLang (see `plan_fingerprint`)."""
        return server_args_fingerprint({**self._adapter.fields_used, **self.environment})

    @property
    def key(self) -> tuple:
        """Equal for ranks that hold equal bytes (same SGLang release, layout, relevant server args)."""
        return (release_id(self.version), self.layout.key, self.fingerprint)

    def __enter__(self) -> RankContext:
        _LOCK.acquire()
        try:
            if self._depth == 0:
                with contextlib.ExitStack() as installing:  # a failed activation undoes what it set
                    installing.enter_context(_rollout_environment_set(self.environment))
                    self._adapter.activate()
                    installing.callback(self._adapter.deactivate)
                    self._installed = installing.pop_all()
            self._depth += 1
        except BaseException:
            _LOCK.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._depth -= 1
            if self._depth == 0:
                self._installed.close()  # the adapter's state, then the environment
        finally:
            _LOCK.release()


def rank_context(server_args: Mapping[str, Any], layout: RankLayout, hf_config: Any) -> RankContext:
    """The rank state of rollout rank `layout.tp_rank`; use as `with rank_context(...) as ctx:`."""
    return RankContext(server_args, layout, hf_config)


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

    def __init__(self, ctx: RankContext):
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


def _server_args_record(ServerArgs, ctx: RankContext) -> tuple[dict, Any]:
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

    def __init__(self, ctx: RankContext):
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

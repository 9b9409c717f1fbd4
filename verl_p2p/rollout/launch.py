"""The SGLang server args a p2p rollout needs, their validation, and their per-replica form.

A p2p rollout engine must publish its weight memory (docs/protocol.md section 1):

- `remote_instance_weight_loader_start_seed_via_transfer_engine=True`: every model-runner rank registers its
  parameters with a Mooncake TransferEngine and publishes them to the engine's bootstrap server;
- `enable_memory_saver=False`: SGLang silently turns the seed off when the memory saver is on (its virtual
  allocations cannot be registered), and verl forces the saver on unless told otherwise;
- `engine_info_bootstrap_port`: the bootstrap server's port, distinct for engines sharing a host.

They are set under `actor_rollout_ref.rollout.engine_kwargs.sglang.*` (conf/p2p/default.yaml sets all three).
verl hands one config to every replica, so the port given there is a base: each standalone replica launches
with `base + replica_rank` (P2PSGLangReplica, registered over verl's `sglang` replica). Hybrid replicas (on
the trainer's GPUs, synced by verl's naive path) launch with verl's own settings: they need the saver.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl_p2p.config import config_field
from verl_p2p.errors import P2PConfigError, UnsupportedLayoutError
from verl_p2p.planning.layout import SPECULATIVE, check_reproducible, check_server_info, dp_problem, speculative_problem
from verl_p2p.planning.weight_caches import HPC_PACKAGE, env_cache_problems, hpc_gemm_problem, server_arg_cache_problems
from verl_p2p.rollout.post_processing import Platform, check_device, check_platform, local_platform

logger = logging.getLogger(__name__)

SEED_FLAG = "remote_instance_weight_loader_start_seed_via_transfer_engine"
MEMORY_SAVER = "enable_memory_saver"
BOOTSTRAP_PORT = "engine_info_bootstrap_port"
P2P_SERVER_ARGS = (SEED_FLAG, MEMORY_SAVER, BOOTSTRAP_PORT)
DEFAULT_BASE_PORT = 6789  # SGLang's own default
OVERRIDE = "actor_rollout_ref.rollout.engine_kwargs.sglang."

_MEMORY_SAVER_REASON = (
    "SGLang disables the transfer-engine seed when the memory saver is on (ServerArgs.validate_transfer_engine), "
    "so the rollout would publish no weights for p2p to write into"
)


def p2p_server_args(base_port: int = DEFAULT_BASE_PORT) -> dict[str, Any]:
    """The engine_kwargs.sglang entries p2p needs (what conf/p2p/default.yaml sets)."""
    return {SEED_FLAG: True, MEMORY_SAVER: False, BOOTSTRAP_PORT: base_port}


def uses_p2p(rollout_config: Any) -> bool:
    """The rollout syncs through verl_p2p: `backend=verl_p2p`, or `p2p` while it resolves to verl_p2p's class.
    Raises P2PConfigError when `p2p` resolves to another package's class while verl_p2p's config is in use."""
    from verl_p2p.backend.identity import check_backend, our_config_signs, uses_verl_p2p

    backend = config_field(config_field(rollout_config, "checkpoint_engine"), "backend")
    check_backend(backend, our_config_signs(rollout_config))
    return uses_verl_p2p(backend)


def sglang_kwargs(rollout_config: Any) -> dict[str, Any]:
    engine_kwargs = config_field(rollout_config, "engine_kwargs") or {}
    return dict(config_field(engine_kwargs, "sglang") or {})


def server_arg_problems(sglang: Mapping[str, Any]) -> list[str]:
    """Each problem as "what is wrong: the override that fixes it"."""
    problems = []
    if sglang.get(SEED_FLAG) is not True:
        problems.append(
            f"{SEED_FLAG} is {sglang.get(SEED_FLAG)!r} (rollout ranks would not publish their weight memory): "
            f"set {OVERRIDE}{SEED_FLAG}=true"
        )
    if MEMORY_SAVER not in sglang:
        problems.append(
            f"{MEMORY_SAVER} is not set, and verl launches SGLang with it on ({_MEMORY_SAVER_REASON}): "
            f"set {OVERRIDE}{MEMORY_SAVER}=false"
        )
    elif sglang[MEMORY_SAVER] is not False:
        problems.append(
            f"{MEMORY_SAVER}={sglang[MEMORY_SAVER]!r} cannot work with p2p ({_MEMORY_SAVER_REASON}): "
            f"set {OVERRIDE}{MEMORY_SAVER}=false"
        )
    speculative = speculative_problem(sglang)
    if speculative is not None:
        problems.append(f"{speculative}: drop {OVERRIDE}{SPECULATIVE}")
    problems += [f"{OVERRIDE}{problem}" for problem in server_arg_cache_problems(sglang)]
    port = sglang.get(BOOTSTRAP_PORT)
    if port is None:
        problems.append(
            f"{BOOTSTRAP_PORT} is not set (the base port of the replicas' engine-info bootstrap servers; replica r "
            f"uses base + r): set {OVERRIDE}{BOOTSTRAP_PORT}={DEFAULT_BASE_PORT}"
        )
    elif not _port(port):
        problems.append(f"{BOOTSTRAP_PORT}={port!r} is not a TCP port: set {OVERRIDE}{BOOTSTRAP_PORT}=<1024..65535>")
    return problems


def rollout_dp_problem(rollout_config: Any) -> str | None:
    """`dp_size > 1` without DP attention, from verl's rollout config (its data_parallel_size is SGLang's dp_size
    unless engine_kwargs.sglang overrides it); None when the rollout runs one model copy per engine."""
    sglang = sglang_kwargs(rollout_config)
    dp = sglang.get("dp_size", config_field(rollout_config, "data_parallel_size"))
    try:
        dp_size = int(dp or 1)
        attn_dp = sglang.get("attn_dp_size")
        attn_dp = None if attn_dp is None else int(attn_dp)
    except (TypeError, ValueError):
        return f"dp_size={dp!r} / attn_dp_size={sglang.get('attn_dp_size')!r} are not integers"
    return dp_problem(dp_size, bool(sglang.get("enable_dp_attention")), attn_dp)


def mtp_problem(rollout_config: Any) -> str | None:
    """verl's own way to turn speculative decoding on (`actor_rollout_ref.model.mtp.enable` and `enable_rollout`,
    which verl's SGLang server turns into `speculative_algorithm`): refused like the server arg itself."""
    mtp = config_field(rollout_config, "mtp")
    if not (mtp and config_field(mtp, "enable") and config_field(mtp, "enable_rollout")):
        return None
    algorithm = config_field(mtp, "speculative_algorithm") or "EAGLE"
    problem = speculative_problem({SPECULATIVE: algorithm})
    if problem is None:
        return None
    return f"{problem}: verl sets it from the MTP config, so set actor_rollout_ref.model.mtp.enable_rollout=false"


def check_server_args(sglang: Mapping[str, Any]) -> None:
    problems = server_arg_problems(sglang)
    if problems:
        raise P2PConfigError(
            "checkpoint_engine.backend=verl_p2p needs these SGLang server args: " + "; ".join(problems)
        )


def replica_server_args(sglang: Mapping[str, Any], replica_rank: int) -> dict[str, Any]:
    """Validated engine_kwargs.sglang for one standalone replica: its bootstrap port is base + replica_rank."""
    check_server_args(sglang)
    port = int(sglang[BOOTSTRAP_PORT]) + int(replica_rank)
    if port > 65535:
        raise P2PConfigError(
            f"replica {replica_rank}'s bootstrap port {sglang[BOOTSTRAP_PORT]} + {replica_rank} exceeds 65535: "
            f"lower {OVERRIDE}{BOOTSTRAP_PORT}"
        )
    return {**sglang, BOOTSTRAP_PORT: port}


def hybrid_server_args(sglang: Mapping[str, Any]) -> dict[str, Any]:
    """engine_kwargs.sglang for a hybrid replica: verl's defaults for what p2p overrides (it needs the saver)."""
    return {k: v for k, v in sglang.items() if k not in P2P_SERVER_ARGS}


def check_live_server_args(server_info: Mapping[str, Any], engine: int | None = None, url: str | None = None) -> None:
    """Check a running server's effective args (`/server_info`): a well-formed answer, a layout p2p can write
    (MalformedAnswerError / UnsupportedLayoutError), and the seed on (SGLang may have turned it off itself)."""
    where = f"rollout engine {engine} ({url})" if engine is not None else f"rollout server {url}"
    check_server_info(server_info, where)
    try:
        check_reproducible(server_info)  # a layout the replica cannot write (pp, dp copies, EPLB, ...): refuse now
    except UnsupportedLayoutError as exc:
        raise UnsupportedLayoutError(f"{where}: {exc}") from exc
    check_device(server_info, where)  # post-load processing p2p's bytes survive (rollout/post_processing.py)
    if SEED_FLAG not in server_info:
        raise P2PConfigError(
            f"{where} (SGLang {server_info.get('version', '?')}) reports no {SEED_FLAG}: p2p needs SGLang >= 0.5.12"
        )
    if server_info.get(SEED_FLAG) is True:
        return
    if server_info.get(MEMORY_SAVER):
        why = f"{MEMORY_SAVER} is on ({_MEMORY_SAVER_REASON}); set {OVERRIDE}{MEMORY_SAVER}=false"
    else:
        why = (
            f"either {OVERRIDE}{SEED_FLAG}=true was not passed, or SGLang could not import mooncake.engine in the "
            "server process and turned it off (install mooncake-transfer-engine where the rollout runs)"
        )
    raise P2PConfigError(f"{where} does not publish its weight memory ({SEED_FLAG}=false): {why}")


@dataclass(frozen=True)
class ServedCheckpoint:
    """The checkpoint verl's SGLang server loads, read where that server launches."""

    path: str
    setting: str  # the option that names it
    hf_config: Mapping[str, Any]  # its config.json, with the server's json_model_override_args applied


def launch_args(rollout_config: Any) -> dict[str, Any]:
    """The args verl 0.9.1's server hands SGLang that p2p's launch checks read: `quantization` from the rollout
    config, then every `engine_kwargs.sglang` entry over it (verl's own order)."""
    return {"quantization": config_field(rollout_config, "quantization"), **sglang_kwargs(rollout_config)}


def served_checkpoint(rollout_config: Any, model_config: Any, where: str) -> ServedCheckpoint:
    """What the server loads: verl 0.9.1 launches SGLang with `model_path=model_config.local_path` and lets
    `engine_kwargs.sglang.model_path` override it. p2p's `rollout_model_path` is the trainer's copy of it, never
    what the server loads. Fails closed (P2PConfigError naming the path and the fix) when its config.json cannot
    be read: whether the rollout serves FP8 is decided from it."""
    args = launch_args(rollout_config)
    path, setting = args.get("model_path"), f"{OVERRIDE}model_path"
    if not path:
        path, setting = getattr(model_config, "local_path", None), "actor_rollout_ref.model.path (verl's local copy)"
    fix = (
        f"set {OVERRIDE}model_path to the local HF checkpoint directory this server loads (readable on the rollout "
        "node)"
    )
    if not path:
        raise P2PConfigError(f"{where}: cannot tell which checkpoint the server loads (no {setting}): {fix}")
    config_file = os.path.join(str(path), "config.json")
    try:
        with open(config_file) as f:
            hf_config = json.load(f)
    except (OSError, ValueError) as exc:
        raise P2PConfigError(
            f"{where}: cannot read {config_file} ({setting}: {type(exc).__name__}: {exc}); p2p decides from it "
            f"whether the rollout serves FP8 before the server launches: {fix}"
        ) from exc
    if not isinstance(hf_config, Mapping):
        raise P2PConfigError(f"{where}: {config_file} ({setting}) is not a JSON object: {fix}")
    overrides = args.get("json_model_override_args") or "{}"
    try:
        overrides = json.loads(overrides) if isinstance(overrides, str) else dict(overrides)
    except (TypeError, ValueError) as exc:
        raise P2PConfigError(
            f"{where}: {OVERRIDE}json_model_override_args={overrides!r} is not a JSON object ({exc}): fix or drop it"
        ) from exc
    return ServedCheckpoint(str(path), setting, {**hf_config, **overrides})


def _hf_field(hf_config: Any, name: str) -> Any:
    if hf_config is None:
        return None
    if isinstance(hf_config, Mapping):
        return hf_config.get(name)
    return getattr(hf_config, name, None)


def fp8_checkpoint(hf_config: Any) -> bool:
    """The rollout loads a quantized checkpoint (its config carries a quantization_config)."""
    return bool(_hf_field(hf_config, "quantization_config"))


def fp8_rollout(args: Mapping[str, Any], hf_config: Any) -> bool:
    """The server serves FP8: a quantized checkpoint, or SGLang told to quantize (`quantization`)."""
    return fp8_checkpoint(hf_config) or bool(args.get("quantization"))


def hpc_installed() -> bool:
    """HPC-Ops is importable in this process (where the server runs, so in its scheduler processes too)."""
    import importlib.util

    return importlib.util.find_spec(HPC_PACKAGE) is not None


def check_server_process(
    sglang: Mapping[str, Any],
    hf_config: Any,
    where: str,
    environ: Mapping[str, str] | None = None,
    platform: Platform | None = None,
    fp8_platform: Any = None,
    hpc: bool | None = None,
) -> None:
    """Checks made in the rollout server's own process, before it launches: what only that host knows.

    Its platform's post-load processing (`post_processing.check_platform`), the environment variables that turn on
    an SGLang derived-weight cache (`planning.weight_caches`; SGLang's scheduler processes inherit them) or a
    model that turns one on when HPC-Ops is installed here, and, for a quantized checkpoint, the FP8 platform of
    this GPU (`replica.fp8.fp8_platform_problem`: the trainer cannot see it). `environ`, `platform`,
    `fp8_platform` and `hpc` (HPC-Ops installed) default to this process's own.
    """
    check_platform(platform or local_platform(sglang.get("device")), where)
    problems = env_cache_problems(os.environ if environ is None else environ)
    architectures = _hf_field(hf_config, "architectures") or ()
    hpc_problem = hpc_gemm_problem(architectures, hpc_installed() if hpc is None else hpc)
    if hpc_problem is not None:
        problems.append(hpc_problem)
    if problems:
        raise P2PConfigError(f"{where}: " + "; ".join(problems))
    if fp8_rollout(sglang, hf_config):
        from verl_p2p.replica.fp8 import Fp8Platform, check_fp8_platform

        check_fp8_platform(fp8_platform or Fp8Platform.local(), where)


class P2PServerLaunch:
    """What p2p adds to verl's SGLang server actor: `sglang_replica.P2PSGLangHttpServer` mixes it in before verl's
    SGLangHttpServer (kept here, where it imports without SGLang's server). With p2p, what only the server's host
    knows is checked before launch (`check_server_process`) on the checkpoint the server loads
    (`served_checkpoint`); after launch `/server_info` is repaired (`repair_scheduler_info`)."""

    config: Any  # verl's RolloutConfig
    model_config: Any  # verl's HFModelConfig (the trainer's model)

    async def launch_server(self, *args, **kwargs):
        if uses_p2p(self.config):  # where the server runs: its post-load processing must keep p2p's bytes
            where = f"rollout server on {socket.gethostname()}"
            served = served_checkpoint(self.config, getattr(self, "model_config", None), where)
            check_server_process(launch_args(self.config), served.hf_config, f"{where} loading {served.path}")
        await super().launch_server(*args, **kwargs)
        # verl's server module imported SGLang's http_server; a server that is not verl's has no state to repair
        http_server = sys.modules.get("sglang.srt.entrypoints.http_server")
        repair_scheduler_info(getattr(http_server, "_global_state", None))


# ---- per-replica launch ----------------------------------------------------------------------------------------


def apply_to_replica(replica: Any) -> None:
    """Give a verl SGLang replica about to launch its p2p server args (called from launch_servers)."""
    config = replica.config
    if (
        not uses_p2p(config)
        or getattr(replica, "is_reward_model", False)
        or getattr(replica, "is_teacher_model", False)
    ):
        return
    sglang = sglang_kwargs(config)
    mode = getattr(getattr(replica, "rollout_mode", None), "value", None)
    if mode == "hybrid":
        new = hybrid_server_args(sglang)
    else:
        for problem in (rollout_dp_problem(config), mtp_problem(config)):
            if problem is not None:
                raise P2PConfigError(f"rollout replica {replica.replica_rank}: {problem}")
        new = replica_server_args(sglang, replica.replica_rank)
        logger.info("p2p: rollout replica %d bootstrap port %d", replica.replica_rank, new[BOOTSTRAP_PORT])
    config = copy.copy(config)  # never change a config another replica may share
    config.engine_kwargs = {**(config.engine_kwargs or {}), "sglang": new}
    replica.config = config


def _port(value: Any) -> bool:
    try:
        return 1 <= int(value) <= 65535 and not isinstance(value, bool)
    except (TypeError, ValueError):
        return False


def repair_scheduler_info(state: Any) -> bool:
    """Make `/server_info` answer again on a server verl launched in-process (True when repaired).

    verl 0.9.1 keeps the third value of SGLang's `Engine._launch_subprocesses` as the scheduler info; from SGLang
    0.5.10 that value is the `PortArgs`, and `/server_info` (which merges the scheduler info into its answer)
    fails with HTTP 500 "'PortArgs' object is not a mapping". p2p reads the rollout's server args from that route,
    so a scheduler info that is not a mapping is replaced by an empty one: the answer keeps every server arg, the
    internal states and the version, which is all `/server_info` is read for. `state` is SGLang's
    `http_server._global_state`.
    """
    if state is None or isinstance(getattr(state, "scheduler_info", None), Mapping):
        return False
    logger.warning(
        "verl_p2p: this server's scheduler info is a %s, not a mapping (verl 0.9.1 with SGLang >= 0.5.10): "
        "/server_info would answer 500; answering without it",
        type(state.scheduler_info).__name__,
    )
    state.scheduler_info = {}
    return True

"""Configurations where `backend=verl_p2p` (or `p2p`) would be ignored or cannot work, refused with the reason
and the fix.

Checked on the driver before anything launches (`verl_p2p.backend.hydra_callback.P2PGuardCallback`, installed by
conf/p2p/default.yaml) and again where each part starts: the rollout leader checks its server's effective args, the
replica launch checks the server args, every engine validates its options (`engine_kwargs.<backend>`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from verl_p2p.backend.identity import ALIAS, BACKEND, BACKEND_NAMES, backend_problem, our_config_signs, uses_verl_p2p
from verl_p2p.config import P2PConfig, config_field, plain
from verl_p2p.errors import P2PConfigError
from verl_p2p.planning.weight_caches import env_cache_problems
from verl_p2p.rollout.launch import mtp_problem, rollout_dp_problem, server_arg_problems
from verl_p2p.trainer.fsdp_config import fsdp_actor_problems

logger = logging.getLogger(__name__)

MAIN_PPO, ONE_STEP_OFF, FULLY_ASYNC = "main_ppo", "one_step_off", "fully_async"
_ENTRY_MODULES = {
    "verl.trainer.main_ppo": MAIN_PPO,
    "verl.experimental.one_step_off_policy.main_ppo": ONE_STEP_OFF,
    "verl.experimental.fully_async_policy.fully_async_main": FULLY_ASYNC,
}
NAIVE_MODES = ("sync", "colocate_async")
_warned: set[str] = set()


def entry_of(config: Mapping[str, Any], task_function: Any = None) -> str:
    """Which verl trainer runs this config: from the Hydra task function, else from the config's shape."""
    module = getattr(task_function, "__module__", None)
    if module in _ENTRY_MODULES:
        return _ENTRY_MODULES[module]
    if "async_training" in config:
        return FULLY_ASYNC
    if "rollout" in config:  # one_step_off's top-level rollout resources
        return ONE_STEP_OFF
    return MAIN_PPO


def trainer_mode_problems(config: Mapping[str, Any], entry: str) -> list[str]:
    """verl trainers that would replace p2p with `naive` (or cannot run it at all)."""
    if entry != MAIN_PPO:
        return []
    trainer = config_field(config, "trainer") or {}
    if not config_field(trainer, "use_v1"):
        return [
            "trainer.use_v1=false runs verl's legacy trainer, which only knows hybrid (colocated) rollout: p2p "
            "needs standalone rollout replicas. Fix: trainer.use_v1=true trainer.v1.trainer_mode=separate_async"
        ]
    mode = config_field(config_field(trainer, "v1") or {}, "trainer_mode")
    if mode in NAIVE_MODES:
        return [
            f"trainer.v1.trainer_mode={mode} syncs weights with verl's `naive` backend whatever "
            "checkpoint_engine.backend says (verl's v1 trainer_base overrides it), so p2p would be silently "
            "ignored. Fix: trainer.v1.trainer_mode=separate_async with standalone rollout "
            "(actor_rollout_ref.rollout.nnodes/n_gpus_per_node), or run verl.experimental.one_step_off_policy / "
            "fully_async_policy, or drop checkpoint_engine.backend=verl_p2p"
        ]
    return []


def separate_pools_problem(config: Mapping[str, Any]) -> str | None:
    """p2p writes into standalone rollout replicas on GPUs of their own. With `hybrid_engine=true` (verl's default)
    the rollout shares the trainer's GPUs and verl syncs it through its own `naive` path: one_step_off and
    fully_async assert against it only after Ray and the workers started, and v1 separate_async would add colocated
    replicas that p2p never writes."""
    if not config_field(config_field(config, "actor_rollout_ref") or {}, "hybrid_engine"):
        return None
    return (
        "actor_rollout_ref.hybrid_engine=true colocates the rollout with the trainer (verl syncs colocated replicas "
        "through its own naive path; one_step_off and fully_async stop on it after start-up). p2p needs separate "
        "trainer and rollout GPU pools. Fix: actor_rollout_ref.hybrid_engine=false, with the rollout pool sized on "
        "its own (one_step_off: rollout.nnodes / rollout.n_gpus_per_node; v1 separate_async: "
        "actor_rollout_ref.rollout.nnodes / n_gpus_per_node)"
    )


LORA_FIX = (
    "Fix: train without LoRA here (merge the adapter into the base checkpoint and set "
    "actor_rollout_ref.model.lora_rank=0 and actor_rollout_ref.model.lora.rank=0), or sync this run with verl's own "
    "checkpoint engine (drop checkpoint_engine.backend=verl_p2p)"
)


def lora_problem(model: Mapping[str, Any]) -> str | None:
    """LoRA on the trainer (`lora_rank`, verl's FSDP/HF field, or `lora.rank`, its Megatron field): p2p exports the
    base weights through Megatron-Bridge and has never been shown to sync adapters or merged weights exactly (verl
    users report adapters silently not synced to disaggregated rollouts), so it refuses rather than guess."""
    ranks = {
        "actor_rollout_ref.model.lora_rank": config_field(model, "lora_rank"),
        "actor_rollout_ref.model.lora.rank": config_field(config_field(model, "lora") or {}, "rank"),
    }
    for name, rank in ranks.items():
        try:
            on = int(rank or 0) > 0
        except (TypeError, ValueError):
            return f"{name}={rank!r} is not an integer. Fix: set it to 0 (p2p does not sync LoRA)"
        if on:
            return (
                f"{name}={rank}: LoRA is on, and p2p syncs only the base weights Megatron-Bridge exports; the "
                f"rollout would serve without the adapter (or with weights never checked to match). {LORA_FIX}"
            )
    return None


RUNTIME_ENV = "ray_kwargs.ray_init.runtime_env.env_vars"


def runtime_env_problems(config: Mapping[str, Any]) -> list[str]:
    """Environment variables the config hands every Ray worker (the rollout servers' too) that turn on an SGLang
    derived-weight cache; the server process checks its own environment again at launch."""
    ray_init = config_field(config_field(config, "ray_kwargs") or {}, "ray_init") or {}
    env_vars = config_field(config_field(ray_init, "runtime_env") or {}, "env_vars") or {}
    environ = {str(k): str(v) for k, v in dict(env_vars).items() if v is not None}
    return [f"{RUNTIME_ENV}.{problem}" for problem in env_cache_problems(environ)]


GUARD_SIGN = "verl_p2p's Hydra guard (conf/p2p/default.yaml) is installed"


def config_problems(config: Mapping[str, Any], entry: str | None = None, guard: bool = False) -> list[str]:
    """Every reason this trainer config cannot run verl_p2p; [] when it can (or when it is not selected).
    `guard`: called by the Hydra guard (so verl_p2p's config is in use whatever the backend resolves to)."""
    rollout = config_field(config_field(config, "actor_rollout_ref"), "rollout") or {}
    checkpoint_engine = config_field(rollout, "checkpoint_engine") or {}
    backend = config_field(checkpoint_engine, "backend")
    if backend not in BACKEND_NAMES:
        return []
    clash = backend_problem(backend, our_config_signs(rollout) + ([GUARD_SIGN] if guard else []))
    if clash is not None:
        return [clash]
    if not uses_verl_p2p(backend):  # `p2p` is another package's backend, and nothing of verl_p2p's is in use
        return []
    problems = trainer_mode_problems(config, entry or entry_of(config))
    pools = separate_pools_problem(config)
    if pools is not None:
        problems.append(pools)
    if config_field(rollout, "name") != "sglang":
        problems.append(
            f"actor_rollout_ref.rollout.name={config_field(rollout, 'name')!r}: p2p writes into SGLang's published "
            "weight memory. Fix: actor_rollout_ref.rollout.name=sglang"
        )
    if config_field(config_field(rollout, "disaggregation") or {}, "enabled"):
        problems.append("rollout.disaggregation.enabled=true: p2p does not sync prefill/decode-disaggregated rollouts")
    engine_kwargs = config_field(checkpoint_engine, "engine_kwargs") or {}
    short, alias = (plain(config_field(engine_kwargs, name)) for name in (BACKEND, ALIAS))
    if backend == ALIAS and short is not None and short != alias:  # conf/ mirrors verl_p2p's options under p2p
        problems.append(
            f"checkpoint_engine.engine_kwargs.{BACKEND} is set, but with backend={ALIAS} verl hands the engine "
            f"engine_kwargs.{ALIAS} only: those options would be ignored. Fix: move them under "
            f"checkpoint_engine.engine_kwargs.{ALIAS}"
        )
    try:
        P2PConfig.from_mapping(config_field(engine_kwargs, backend))
    except P2PConfigError as exc:
        problems.append(str(exc))
    problems += server_arg_problems(dict(config_field(config_field(rollout, "engine_kwargs") or {}, "sglang") or {}))
    problems += runtime_env_problems(config)
    model = config_field(config_field(config, "actor_rollout_ref"), "model") or {}
    for problem in (rollout_dp_problem(rollout), mtp_problem(rollout) or mtp_problem(model), lora_problem(model)):
        if problem is not None:
            problems.append(problem)
    problems += fsdp_actor_problems(config, backend)  # an FSDP actor: what its full-tensor stream cannot serve
    return problems


def check_config(config: Mapping[str, Any], entry: str | None = None, guard: bool = False) -> None:
    """Raise one P2PConfigError listing every problem of `config_problems`."""
    problems = config_problems(config, entry, guard)
    if problems:
        rollout = config_field(config_field(config, "actor_rollout_ref"), "rollout") or {}
        backend = config_field(config_field(rollout, "checkpoint_engine"), "backend")
        raise P2PConfigError(
            f"checkpoint_engine.backend={backend} cannot run with this config:\n  - " + "\n  - ".join(problems)
        )


def warn_hybrid_actor(owner: Any) -> None:
    """Trainer rank 0: say loudly that hybrid (colocated) replicas are synced by verl's naive path, not p2p."""
    config = getattr(owner, "config", None)
    if config is None or not config_field(config, "hybrid_engine") or "hybrid" in _warned:
        return
    _warned.add("hybrid")
    logger.warning(
        "checkpoint_engine.backend=verl_p2p with actor_rollout_ref.hybrid_engine=true: rollout replicas colocated on "
        "the trainer GPUs are synced by verl's naive path; p2p syncs only standalone replicas (v1 separate_async, "
        "one_step_off, fully_async). In v1 sync/colocate_async trainers p2p is never used."
    )

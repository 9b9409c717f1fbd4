"""Configurations where `backend=p2p` would be ignored or cannot work, refused with the reason and the fix.

Checked on the driver before anything launches (`verl_p2p.backend.hydra_callback.P2PGuardCallback`, installed by
conf/p2p/default.yaml) and again where each part starts: the rollout leader checks its server's effective args, the
replica launch checks the server args, every engine validates `engine_kwargs.p2p`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from verl_p2p.config import P2PConfig, config_field
from verl_p2p.errors import P2PConfigError
from verl_p2p.rollout.launch import server_arg_problems

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
            "fully_async_policy, or drop checkpoint_engine.backend=p2p"
        ]
    return []


def config_problems(config: Mapping[str, Any], entry: str | None = None) -> list[str]:
    """Every reason this trainer config cannot run p2p; [] when it can (or when p2p is not selected)."""
    rollout = config_field(config_field(config, "actor_rollout_ref"), "rollout") or {}
    checkpoint_engine = config_field(rollout, "checkpoint_engine") or {}
    if config_field(checkpoint_engine, "backend") != "p2p":
        return []
    problems = trainer_mode_problems(config, entry or entry_of(config))
    if config_field(rollout, "name") != "sglang":
        problems.append(
            f"actor_rollout_ref.rollout.name={config_field(rollout, 'name')!r}: p2p writes into SGLang's published "
            "weight memory. Fix: actor_rollout_ref.rollout.name=sglang"
        )
    if config_field(config_field(rollout, "disaggregation") or {}, "enabled"):
        problems.append("rollout.disaggregation.enabled=true: p2p does not sync prefill/decode-disaggregated rollouts")
    try:
        P2PConfig.from_mapping(config_field(config_field(checkpoint_engine, "engine_kwargs") or {}, "p2p"))
    except P2PConfigError as exc:
        problems.append(str(exc))
    problems += server_arg_problems(dict(config_field(config_field(rollout, "engine_kwargs") or {}, "sglang") or {}))
    return problems


def check_config(config: Mapping[str, Any], entry: str | None = None) -> None:
    """Raise one P2PConfigError listing every problem of `config_problems`."""
    problems = config_problems(config, entry)
    if problems:
        raise P2PConfigError(
            "checkpoint_engine.backend=p2p cannot run with this config:\n  - " + "\n  - ".join(problems)
        )


def warn_hybrid_actor(owner: Any) -> None:
    """Trainer rank 0: say loudly that hybrid (colocated) replicas are synced by verl's naive path, not p2p."""
    config = getattr(owner, "config", None)
    if config is None or not config_field(config, "hybrid_engine") or "hybrid" in _warned:
        return
    _warned.add("hybrid")
    logger.warning(
        "checkpoint_engine.backend=p2p with actor_rollout_ref.hybrid_engine=true: rollout replicas colocated on the "
        "trainer GPUs are synced by verl's naive path; p2p syncs only standalone replicas (v1 separate_async, "
        "one_step_off, fully_async). In v1 sync/colocate_async trainers p2p is never used."
    )

"""The Ray workers' environment, resolved in the driver before verl hands it to `ray.init`.

verl 0.9.1's `run_ppo` merges `ray_kwargs.ray_init.runtime_env` into a new config and passes it to `ray.init`
unresolved: an interpolation there, such as conf/p2p/default.yaml's `MOONCAKE_PROTOCOL: ${...verl_p2p.protocol}`,
would reach every Ray worker, the SGLang servers included, as its literal text. `P2PRayEnvCallback` (installed by
conf/p2p/default.yaml) resolves `ray_kwargs.ray_init` in place when Hydra starts the run, before Hydra copies the
config for verl's task function, so `protocol` set once reaches the trainer (through its options) and the rollout
servers (through MOONCAKE_PROTOCOL). At job start it refuses, before Ray starts, a config whose workers would
still get an interpolation, or a MOONCAKE_PROTOCOL that differs from p2p's `protocol`.
"""

from __future__ import annotations

import logging
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf, read_write

from verl_p2p.backend.identity import BACKEND_NAMES

logger = logging.getLogger(__name__)

RAY_INIT = "ray_kwargs.ray_init"
PROTOCOL_ENV = f"{RAY_INIT}.runtime_env.env_vars.MOONCAKE_PROTOCOL"


def _keys(node: DictConfig | ListConfig) -> list[Any]:
    return list(node.keys()) if isinstance(node, DictConfig) else list(range(len(node)))


def resolve_ray_init(config: DictConfig) -> None:
    """Replace every interpolation under `ray_kwargs.ray_init` with its value, resolved against the whole config."""
    node = OmegaConf.select(config, RAY_INIT, throw_on_resolution_failure=False)
    if isinstance(node, (DictConfig, ListConfig)):
        _resolve_in_place(node)


def _resolve_in_place(node: DictConfig | ListConfig) -> None:
    for key in _keys(node):
        if OmegaConf.is_interpolation(node, key):
            value = node[key]
            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value, resolve=True)
            with read_write(node):
                node[key] = value
        else:
            child = node[key]
            if isinstance(child, (DictConfig, ListConfig)):
                _resolve_in_place(child)


def _unresolved(node: Any, path: str) -> list[tuple[str, str]]:
    """(path, interpolation text) of every interpolation under `node`."""
    if not isinstance(node, (DictConfig, ListConfig)):
        return []
    found = []
    for key in _keys(node):
        child = node._get_node(key)
        if OmegaConf.is_interpolation(node, key):
            found.append((f"{path}.{key}", str(child._value())))
        else:
            found += _unresolved(child, f"{path}.{key}")
    return found


def ray_env_problems(config: DictConfig) -> list[str]:
    """Why the Ray workers would not get the environment this config means; [] when they would."""
    ray_init = OmegaConf.select(config, RAY_INIT, throw_on_resolution_failure=False)
    problems = [
        f"{path}={text!r}: verl's run_ppo hands ray_init to ray.init unresolved, so every Ray worker would get this "
        f"literal text. Fix: set {path} to a plain value (a multirun sweep skips the resolution at run start)"
        for path, text in _unresolved(ray_init, RAY_INIT)
    ]
    backend = OmegaConf.select(config, "actor_rollout_ref.rollout.checkpoint_engine.backend", default=None)
    if problems or backend not in BACKEND_NAMES:
        return problems
    key = f"actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.{backend}.protocol"
    protocol = OmegaConf.select(config, key, default=None, throw_on_resolution_failure=False)
    env = OmegaConf.select(config, PROTOCOL_ENV, default=None)
    if env is not None and protocol is not None and str(env) != str(protocol):
        problems.append(
            f"{PROTOCOL_ENV}={env!r} but {key}={protocol!r}: the rollout servers' Mooncake engines would speak "
            f"another protocol than the trainer's. Fix: set the protocol once, as {key}, and leave MOONCAKE_PROTOCOL "
            "to conf/p2p/default.yaml, which forwards it"
        )
    return problems


class P2PRayEnvCallback(Callback):
    """Resolves `ray_kwargs.ray_init` at run start; refuses at job start what would still reach Ray wrong."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        resolve_ray_init(config)

    def on_job_start(self, config: DictConfig, *, task_function: Any = None, **kwargs: Any) -> None:
        problems = ray_env_problems(config)
        if problems:
            message = "; ".join(problems)
            logger.error("%s", message)
            raise SystemExit(f"verl_p2p refused the run: {message}")

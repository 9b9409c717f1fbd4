"""Compose verl 0.9.1's real trainer configs with this repository's conf/ (test support)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import verl
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
VERL = Path(verl.__file__).resolve().parent

# each entry module's own Hydra config dir (its @hydra.main config_path)
CONFIG_DIRS = {
    "verl.trainer.main_ppo": VERL / "trainer" / "config",
    "verl.experimental.one_step_off_policy.main_ppo": VERL / "experimental" / "one_step_off_policy" / "config",
    "verl.experimental.fully_async_policy.fully_async_main": VERL / "experimental" / "fully_async_policy" / "config",
}
OVERLAY = [f"hydra.searchpath=[pkg://verl.trainer.config,file://{CONF}]", "+p2p=default"]


def compose_config(module: str, args: Sequence[str]) -> DictConfig:
    """What `python -m module *args` would hand its task function (with the `hydra` node)."""
    config_dir, config_name, overrides = str(CONFIG_DIRS[module]), None, []
    for arg in args:
        if arg.startswith("--config-path="):
            config_dir = arg.split("=", 1)[1]
        elif arg.startswith("--config-name="):
            config_name = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=True)


def recipe_command(script: Path, **env: str) -> tuple[str, list[str]]:
    """(python module, its arguments) of a recipe, from the recipe itself (P2P_PRINT_COMMAND=1)."""
    out = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        check=True,
        timeout=60,
        env={**os.environ, "P2P_PRINT_COMMAND": "1", **env},
    ).stdout
    parts = out.decode().split("\0")
    assert parts[-1] == "", "recipe output must be NUL-terminated arguments"
    return parts[0], parts[1:-1]


def task_config(cfg: DictConfig) -> DictConfig:
    """What the entry validates: the task config, resolved; one_step_off's main() first fills the rollout section
    from its top-level `rollout` (verl's main_ppo configs have none: their rollout section is already filled)."""
    cfg = cfg.copy()
    with open_dict(cfg):
        del cfg["hydra"]
    if "rollout" in cfg:
        cfg.actor_rollout_ref.rollout.nnodes = cfg.rollout.nnodes
        cfg.actor_rollout_ref.rollout.n_gpus_per_node = cfg.rollout.n_gpus_per_node
    OmegaConf.resolve(cfg)
    return cfg

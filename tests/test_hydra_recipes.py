"""conf/ and every recipe compose against verl 0.9.1's real trainer configs, and what they compose resolves:
the backend (`verl_p2p`) to P2PCheckpointEngine, the manager class to P2PCheckpointEngineManager, its options through
P2PConfig, the rollout section through verl's own RolloutConfig dataclass, and the guards pass."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from support.compose import CONF, OVERLAY, ROOT, compose_config, recipe_command
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import load_class_from_fqn
from verl.workers.config import CheckpointEngineConfig, RolloutConfig

from verl_p2p.backend.engine import P2PCheckpointEngine
from verl_p2p.backend.guards import check_config, entry_of
from verl_p2p.backend.manager import P2PCheckpointEngineManager
from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PConfigError
from verl_p2p.rollout.launch import p2p_server_args

KWARGS = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs"
RECIPES = sorted((ROOT / "recipes").glob("*.sh"))
RECIPES = [r for r in RECIPES if r.name != "common.sh"]
TINY = ROOT / "recipes" / "tiny_grpo_2gpu.sh"  # checks its own weights by default; see test_tiny_recipe.py
# the tiny runs and the learning runs built on them check their own weights by default
TINY_RECIPES = (
    TINY,
    *(ROOT / "recipes" / name for name in ("tiny_fully_async_2gpu.sh", "learn_grpo.sh", "learn_fully_async.sh")),
)


def check_p2p_config(cfg, module: str) -> RolloutConfig:
    """The checks every composed p2p config must pass; returns verl's RolloutConfig built from it."""
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.checkpoint_engine.backend == "verl_p2p"  # the unambiguous name (verl may ship its own `p2p`)
    assert CheckpointEngineRegistry.get(rollout.checkpoint_engine.backend) is P2PCheckpointEngine
    P2PConfig.from_mapping(rollout.checkpoint_engine.engine_kwargs.verl_p2p)
    check_config(cfg, entry_of(cfg, _task(module)), guard=True)
    assert OmegaConf.to_container(cfg.hydra.callbacks) == {
        "verl_p2p_guard": {"_target_": "verl_p2p.backend.hydra_callback.P2PGuardCallback"},
        "verl_p2p_ray_env": {"_target_": "verl_p2p.backend.ray_env.P2PRayEnvCallback"},
    }
    task = OmegaConf.to_container(cfg)
    del task["hydra"]  # what the task function gets
    resolved = OmegaConf.to_container(OmegaConf.create(task), resolve=True)  # every interpolation resolves
    assert resolved["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]["MOONCAKE_PROTOCOL"] == (
        rollout.checkpoint_engine.engine_kwargs.verl_p2p.protocol
    )
    ce = omega_conf_to_dataclass(rollout.checkpoint_engine)
    assert isinstance(ce, CheckpointEngineConfig) and ce.custom_backend_module == "verl_p2p"
    rollout_config = omega_conf_to_dataclass(rollout)  # verl's own validation of the rollout section
    assert isinstance(rollout_config, RolloutConfig)
    return rollout_config


def ray_env_as_verl_passes_it(cfg) -> dict:
    """The Ray workers' env_vars as verl 0.9.1's run_ppo hands them to ray.init (no interpolation resolved there),
    after Hydra's run-start callbacks (the config's own, as `hydra.main` calls them before the task function)."""
    from hydra._internal.callbacks import Callbacks
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    cfg = cfg.copy()
    Callbacks(cfg).on_run_start(config=cfg, config_name=None)
    ray_init = cfg.ray_kwargs.get("ray_init", {})
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(cfg), ray_init.get("runtime_env", {}))
    return OmegaConf.to_container(OmegaConf.create({**ray_init, "runtime_env": runtime_env}))["runtime_env"]["env_vars"]


def _task(module: str):
    def main():  # stands for the entry's @hydra.main task function
        pass

    main.__module__ = module
    return main


def test_conf_sets_every_p2p_option_with_its_default_and_the_server_args():
    overlay = yaml.safe_load((CONF / "p2p" / "default.yaml").read_text())
    rollout = overlay["actor_rollout_ref"]["rollout"]
    p2p = rollout["checkpoint_engine"]["engine_kwargs"]["verl_p2p"]
    assert rollout["checkpoint_engine"]["engine_kwargs"]["p2p"] == "${.verl_p2p}"  # the same, for backend=p2p
    assert list(p2p) == P2PConfig.valid_keys()
    defaults = {f.name: f.default for f in dataclasses.fields(P2PConfig) if f.name != "extra"}
    lists = {"check_weight_update_skip_list": (), "unused_hf_tensors_allowed": ()}
    assert P2PConfig.from_mapping(p2p) == P2PConfig(**{**defaults, **lists})
    assert rollout["engine_kwargs"]["sglang"] == p2p_server_args()
    assert rollout["checkpoint_manager_class"] == "verl_p2p.backend.manager.P2PCheckpointEngineManager"


@pytest.mark.parametrize(
    "module",
    [
        "verl.trainer.main_ppo",
        "verl.experimental.one_step_off_policy.main_ppo",
        "verl.experimental.fully_async_policy.fully_async_main",
    ],
)
def test_overlay_composes_with_each_trainers_own_config(module):
    name = {
        "verl.trainer.main_ppo": "ppo_megatron_trainer",
        "verl.experimental.one_step_off_policy.main_ppo": "one_step_off_ppo_megatron_trainer",
        "verl.experimental.fully_async_policy.fully_async_main": "fully_async_ppo_megatron_trainer",
    }[module]
    extra = ["trainer.v1.trainer_mode=separate_async"] if module == "verl.trainer.main_ppo" else []
    cfg = compose_config(module, [f"--config-name={name}", *OVERLAY, *extra])
    check_p2p_config(cfg, module)
    manager = load_class_from_fqn(cfg.actor_rollout_ref.rollout.checkpoint_manager_class, "CheckpointEngineManager")
    assert manager is P2PCheckpointEngineManager


def test_ready_config_for_v1_separate_async():
    cfg = compose_config("verl.trainer.main_ppo", [f"--config-path={CONF}", "--config-name=ppo_megatron_trainer_p2p"])
    check_p2p_config(cfg, "verl.trainer.main_ppo")
    assert cfg.trainer.v1.trainer_mode == "separate_async"
    assert cfg.actor_rollout_ref.hybrid_engine is False


@pytest.mark.parametrize("script", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_composes_and_resolves(script: Path):
    module, args = recipe_command(script)
    cfg = compose_config(module, args)
    rollout_config = check_p2p_config(cfg, module)
    env = ray_env_as_verl_passes_it(cfg)
    assert env["MOONCAKE_PROTOCOL"] == rollout_config.checkpoint_engine.engine_kwargs["p2p"]["protocol"]
    assert not [k for k, v in env.items() if "${" in str(v)], env  # the rollout servers would see the literal text
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.actor_rollout_ref.actor.strategy == ("fsdp2" if "_fsdp_" in script.name else "megatron")
    assert rollout_config.name == "sglang"
    tiny = script in TINY_RECIPES
    assert rollout_config.checkpoint_engine.engine_kwargs["verl_p2p"]["check_weight_update_equal"] is tiny
    assert ("Qwen3" in cfg.actor_rollout_ref.model.path) is not tiny
    if module == "verl.trainer.main_ppo":
        assert cfg.trainer.v1.trainer_mode == "separate_async"
        assert cfg.data.train_batch_size == (
            cfg.trainer.v1.separate_async.parameter_sync_step * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        )  # verl's separate_async asserts this at start
        assert cfg.actor_rollout_ref.rollout.nnodes > 0
        # separate pools: no rollout replicas on the trainer GPUs; verl's TaskRunnerV1 runs on the transfer queue
        assert cfg.actor_rollout_ref.hybrid_engine is False and cfg.transfer_queue.enable is True
    else:
        assert cfg.actor_rollout_ref.hybrid_engine is False  # one_step_off asserts this at start
        manager = load_class_from_fqn(rollout_config.checkpoint_manager_class, "CheckpointEngineManager")
        assert manager is P2PCheckpointEngineManager
    if "30b_a3b" in script.name:
        assert cfg.actor_rollout_ref.actor.megatron.expert_model_parallel_size == 8
        assert rollout_config.expert_parallel_size == 8


@pytest.mark.parametrize("script", [r for r in RECIPES if "4b_one_step_off" in r.name], ids=lambda r: r.stem)
def test_recipe_toggles(script: Path):
    module, args = recipe_command(script, CHECK_WEIGHTS="1", P2P_MANAGER="engine", P2P_PROTOCOL="tcp")
    cfg = compose_config(module, args)
    rollout_config = check_p2p_config(cfg, module)
    p2p = rollout_config.checkpoint_engine.engine_kwargs["verl_p2p"]
    assert p2p["check_weight_update_equal"] is True and p2p["protocol"] == "tcp"
    assert rollout_config.load_format == "auto" and cfg.trainer.resume_mode == "disable"
    assert rollout_config.checkpoint_manager_class is None  # verl's stock manager


def test_overlay_with_backend_p2p_hands_the_engine_the_same_options():
    """Users write backend=p2p: with the overlay, verl then passes engine_kwargs.p2p, which mirrors verl_p2p."""
    args = [f"--config-path={CONF}", "--config-name=ppo_megatron_trainer_p2p"]
    cfg = compose_config(
        "verl.trainer.main_ppo",
        [*args, "actor_rollout_ref.rollout.checkpoint_engine.backend=p2p", f"{KWARGS}.verl_p2p.protocol=tcp"],
    )
    check_config(cfg, "main_ppo", guard=True)
    ce = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)
    assert CheckpointEngineRegistry.get(ce.backend) is P2PCheckpointEngine
    assert ce.engine_kwargs["p2p"] == ce.engine_kwargs["verl_p2p"] and ce.engine_kwargs["p2p"]["protocol"] == "tcp"


def test_options_left_under_the_other_name_are_refused_not_ignored():
    args = [f"--config-path={CONF}", "--config-name=ppo_megatron_trainer_p2p"]
    cfg = compose_config("verl.trainer.main_ppo", [*args, f"{KWARGS}.p2p={{protocol: tcp}}"])
    with pytest.raises(P2PConfigError, match="engine_kwargs.p2p is set, but with backend=verl_p2p .* would be ignored"):
        check_config(cfg, "main_ppo", guard=True)

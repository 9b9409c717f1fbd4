"""conf/p2p/fsdp.yaml composes with verl 0.9.1's FSDP trainer configs (one_step_off and main_ppo) and passes every
check a composed p2p config must pass (tests/test_hydra_recipes.py's `check_p2p_config`)."""

from __future__ import annotations

import pytest
from support.compose import CONF, compose_config
from test_hydra_recipes import check_p2p_config

FSDP_OVERLAY = [f"hydra.searchpath=[pkg://verl.trainer.config,file://{CONF}]", "+p2p=fsdp"]


@pytest.mark.parametrize(
    ("module", "name", "extra"),
    [
        ("verl.experimental.one_step_off_policy.main_ppo", "one_step_off_ppo_trainer", []),
        ("verl.trainer.main_ppo", "ppo_trainer", ["trainer.v1.trainer_mode=separate_async"]),
    ],
)
def test_fsdp_overlay_composes_with_verls_fsdp_trainer_configs(module, name, extra):
    cfg = compose_config(module, [f"--config-name={name}", *FSDP_OVERLAY, *extra])
    check_p2p_config(cfg, module)
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2"
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.verl_p2p.export_mode == "auto"

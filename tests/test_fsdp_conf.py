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


def test_the_guard_refuses_lora_merged_or_not_and_a_megatron_export_mode_for_an_fsdp_actor_before_launch():
    from verl_p2p.backend.guards import config_problems

    module, name = "verl.experimental.one_step_off_policy.main_ppo", "one_step_off_ppo_trainer"
    kwargs = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.verl_p2p"
    lora = compose_config(module, [f"--config-name={name}", *FSDP_OVERLAY, "actor_rollout_ref.model.lora_rank=8"])
    (problem,) = config_problems(lora, guard=True)
    assert "LoRA" in problem and "lora_rank=8" in problem
    merged = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=True"]
    (problem,) = config_problems(compose_config(module, [f"--config-name={name}", *FSDP_OVERLAY, *merged]), guard=True)
    assert "LoRA" in problem  # merged weights have no witness test yet: refused as well
    mode = compose_config(module, [f"--config-name={name}", *FSDP_OVERLAY, f"{kwargs}.export_mode=pp_local"])
    (problem,) = config_problems(mode, guard=True)
    assert "export_mode='pp_local'" in problem and "Megatron export" in problem

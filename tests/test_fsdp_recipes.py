"""The real-model FSDP recipes (Qwen3-4B on verl's FSDP2 trainer: one_step_off and v1 separate_async) compose
against verl 0.9.1's own FSDP configs, pass every p2p check and verl's own config validation, and keep the trainer
and rollout pools apart (hybrid_engine=false) as p2p needs."""

from __future__ import annotations

import pytest
from support.compose import ROOT, compose_config, recipe_command, task_config
from test_hydra_recipes import check_p2p_config, ray_env_as_verl_passes_it

FSDP_RECIPES = {
    "one_step_off": ROOT / "recipes" / "qwen3_4b_fsdp_one_step_off.sh",
    "separate_async": ROOT / "recipes" / "qwen3_4b_fsdp_separate_async.sh",
}
ENTRIES = {
    "one_step_off": ("verl.experimental.one_step_off_policy.main_ppo", "one_step_off_ppo_trainer"),
    "separate_async": ("verl.trainer.main_ppo", "ppo_trainer"),
}


@pytest.mark.parametrize("run", sorted(FSDP_RECIPES))
def test_fsdp_recipe_composes_on_verls_fsdp_config_and_passes_verls_validation(run):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    module, args = recipe_command(FSDP_RECIPES[run], P2P_PROTOCOL="tcp")
    assert (module, f"--config-name={ENTRIES[run][1]}") == (ENTRIES[run][0], args[0])
    assert "+p2p=fsdp" in args and not [a for a in args if "megatron" in a]  # verl's FSDP config, p2p's FSDP overlay
    cfg = compose_config(module, args)
    rollout_config = check_p2p_config(cfg, module)
    actor = cfg.actor_rollout_ref.actor
    assert actor.strategy == "fsdp2" and cfg.actor_rollout_ref.ref.strategy == "fsdp2"
    assert rollout_config.checkpoint_engine.engine_kwargs["verl_p2p"]["export_mode"] == "auto"
    assert rollout_config.checkpoint_engine.engine_kwargs["verl_p2p"]["protocol"] == "tcp"
    assert ray_env_as_verl_passes_it(cfg)["MOONCAKE_PROTOCOL"] == "tcp"  # given once, reaches the rollout servers
    assert "Qwen3-4B" in cfg.actor_rollout_ref.model.path and "hf_model" in actor.checkpoint.save_contents
    # separate pools: no rollout on the trainer's GPUs (one_step_off asserts it; v1 would add hybrid replicas)
    assert cfg.actor_rollout_ref.hybrid_engine is False
    if run == "separate_async":
        v1 = cfg.trainer.v1
        assert cfg.trainer.use_v1 is True and v1.trainer_mode == "separate_async"
        assert cfg.transfer_queue.enable is True  # run_ppo then hands TRANSFER_QUEUE_ENABLE to every Ray worker
        assert cfg.data.train_batch_size == v1.separate_async.parameter_sync_step * actor.ppo_mini_batch_size
        rollout = cfg.actor_rollout_ref.rollout
        pools = (cfg.trainer.n_gpus_per_node, rollout.n_gpus_per_node)
    else:
        pools = (cfg.trainer.n_gpus_per_node, cfg.rollout.n_gpus_per_node)
    assert pools == (4, 4)
    cfg = task_config(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert need_reference_policy(cfg) and not need_critic(cfg)


def test_fsdp_v1_without_separate_pools_is_what_verl_would_colocate():
    """Without the recipe's v1 settings verl's FSDP config is colocated and synchronous (its naive path): the guard
    refuses that before launch, naming the fix the recipe applies."""
    from verl_p2p.backend.guards import config_problems

    module, args = recipe_command(FSDP_RECIPES["separate_async"])
    args = [a for a in args if not a.startswith("trainer.v1.trainer_mode=")]
    cfg = compose_config(module, args)
    (problem,) = config_problems(cfg, "main_ppo", guard=True)
    assert "trainer.v1.trainer_mode=sync" in problem and "separate_async" in problem

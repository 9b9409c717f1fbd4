#!/usr/bin/env bash
# GRPO, Qwen3-4B, one node of 8 GPUs: verl one_step_off_policy, Megatron trainer on 4 GPUs, 4 SGLang replicas
# (TP=1) on the other 4, weights synced with checkpoint_engine.backend=verl_p2p through verl_p2p's manager
# (P2P_MANAGER=engine: verl's stock manager). See recipes/README.md for the toggles.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$(dirname "${BASH_SOURCE[0]}")/qwen3_4b/grpo_task.sh"

CKPTS_DIR=${CKPTS_DIR:-$HOME/ckpts/verl-p2p/qwen3-4b-one-step-off}

ARGS=(
    "${QWEN3_4B_GRPO_ARGS[@]}"
    data.train_batch_size=128
    actor_rollout_ref.hybrid_engine=false
    actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2
    rollout.nnodes=1
    rollout.n_gpus_per_node=$ROLLOUT_GPUS
    trainer.experiment_name=qwen3-4b-one-step-off-p2p
    trainer.default_local_dir="$CKPTS_DIR"
)
p2p_overrides
# one_step_off's own config (its module's config dir) plus the p2p overlay from this repository.
p2p_launch verl.experimental.one_step_off_policy.main_ppo --config-name=one_step_off_ppo_megatron_trainer \
    "hydra.searchpath=[pkg://verl.trainer.config,file://$P2P_ROOT/conf]" +p2p=default \
    "${ARGS[@]}" "${P2P_OVERRIDES[@]}" "$@"

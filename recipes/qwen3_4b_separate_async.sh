#!/usr/bin/env bash
# GRPO, Qwen3-4B, one node of 8 GPUs: verl v1 separate_async, Megatron trainer on 4 GPUs, 4 standalone SGLang
# replicas (TP=1) on the other 4, weights synced with checkpoint_engine.backend=verl_p2p (verl's stock manager
# drives the p2p engine hooks). See recipes/README.md for the toggles (CHECK_WEIGHTS=1, P2P_PROTOCOL=tcp, ...).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$(dirname "${BASH_SOURCE[0]}")/qwen3_4b/grpo_task.sh"

CKPTS_DIR=${CKPTS_DIR:-$HOME/ckpts/verl-p2p/qwen3-4b-separate-async}
PARAMETER_SYNC_STEP=4
MINI_BATCH=32

ARGS=(
    "${QWEN3_4B_GRPO_ARGS[@]}"
    data.train_batch_size=$((PARAMETER_SYNC_STEP * MINI_BATCH))
    actor_rollout_ref.actor.ppo_mini_batch_size=$MINI_BATCH
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.nnodes=1
    actor_rollout_ref.rollout.n_gpus_per_node=$ROLLOUT_GPUS
    trainer.v1.separate_async.parameter_sync_step=$PARAMETER_SYNC_STEP
    trainer.experiment_name=qwen3-4b-separate-async-p2p
    trainer.default_local_dir="$CKPTS_DIR"
)
p2p_overrides
p2p_launch verl.trainer.main_ppo --config-path="$P2P_ROOT/conf" --config-name=ppo_megatron_trainer_p2p \
    "${ARGS[@]}" "${P2P_OVERRIDES[@]}" "$@"

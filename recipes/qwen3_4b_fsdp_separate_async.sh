#!/usr/bin/env bash
# GRPO, Qwen3-4B, one node of 8 GPUs: verl v1 separate_async, FSDP2 trainer (verl's default) on 4 GPUs, 4 standalone
# SGLang replicas (TP=1) on the other 4, weights synced with checkpoint_engine.backend=verl_p2p (verl's stock manager
# drives the p2p engine hooks). What verl 0.9.1's v1 path needs besides p2p's FSDP overlay, as the Megatron ready
# config (conf/ppo_megatron_trainer_p2p.yaml) sets it: trainer_mode=separate_async (sync and colocate_async replace
# every backend with `naive`), hybrid_engine=false (no rollout replicas on the trainer GPUs) and the transfer queue
# (TaskRunnerV1 runs on it; enabled here so every Ray worker gets TRANSFER_QUEUE_ENABLE). See recipes/README.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$(dirname "${BASH_SOURCE[0]}")/qwen3_4b/grpo_task.sh"

CKPTS_DIR=${CKPTS_DIR:-$HOME/ckpts/verl-p2p/qwen3-4b-fsdp-separate-async}
PARAMETER_SYNC_STEP=4
MINI_BATCH=32

ARGS=(
    "${QWEN3_4B_GRPO_ARGS[@]}"
    trainer.use_v1=true
    trainer.v1.trainer_mode=separate_async
    actor_rollout_ref.hybrid_engine=false
    transfer_queue.enable=true
    data.train_batch_size=$((PARAMETER_SYNC_STEP * MINI_BATCH))
    actor_rollout_ref.model.use_remove_padding=true
    actor_rollout_ref.model.enable_gradient_checkpointing=true
    actor_rollout_ref.actor.ppo_mini_batch_size=$MINI_BATCH
    actor_rollout_ref.actor.checkpoint.save_contents="['model','optimizer','extra','hf_model']"
    actor_rollout_ref.rollout.nnodes=1
    actor_rollout_ref.rollout.n_gpus_per_node=$ROLLOUT_GPUS
    trainer.v1.separate_async.parameter_sync_step=$PARAMETER_SYNC_STEP
    trainer.experiment_name=qwen3-4b-fsdp-separate-async-p2p
    trainer.default_local_dir="$CKPTS_DIR"
)
p2p_overrides
# verl's own FSDP trainer config plus p2p's FSDP overlay from this repository.
p2p_launch verl.trainer.main_ppo --config-name=ppo_trainer \
    "hydra.searchpath=[pkg://verl.trainer.config,file://$P2P_ROOT/conf]" +p2p=fsdp \
    "${ARGS[@]}" "${P2P_OVERRIDES[@]}" "$@"

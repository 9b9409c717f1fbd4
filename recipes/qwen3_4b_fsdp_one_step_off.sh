#!/usr/bin/env bash
# GRPO, Qwen3-4B, one node of 8 GPUs: verl one_step_off_policy, FSDP2 trainer (verl's default) on 4 GPUs, 4 SGLang
# replicas (TP=1) on the other 4, weights synced with checkpoint_engine.backend=verl_p2p through verl_p2p's manager
# (P2P_MANAGER=engine: verl's stock manager). Every FSDP rank streams verl's full tensors and writes its share of
# every rollout rank (conf/p2p/fsdp.yaml). See recipes/README.md for the checklist and the toggles.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$(dirname "${BASH_SOURCE[0]}")/qwen3_4b/grpo_task.sh"

CKPTS_DIR=${CKPTS_DIR:-$HOME/ckpts/verl-p2p/qwen3-4b-fsdp-one-step-off}

ARGS=(
    "${QWEN3_4B_GRPO_ARGS[@]}"
    data.train_batch_size=128
    # separate trainer and rollout pools (one_step_off asserts it): p2p writes into standalone SGLang replicas
    actor_rollout_ref.hybrid_engine=false
    actor_rollout_ref.model.use_remove_padding=true
    actor_rollout_ref.model.enable_gradient_checkpointing=true
    actor_rollout_ref.actor.ppo_mini_batch_size=32
    # the HF model next to the FSDP shards at each save (what a user serves; FSDP writes it only when asked)
    actor_rollout_ref.actor.checkpoint.save_contents="['model','optimizer','extra','hf_model']"
    rollout.nnodes=1
    rollout.n_gpus_per_node=$ROLLOUT_GPUS
    trainer.experiment_name=qwen3-4b-fsdp-one-step-off-p2p
    trainer.default_local_dir="$CKPTS_DIR"
)
p2p_overrides
# one_step_off's own FSDP config (its module's config dir) plus p2p's FSDP overlay from this repository.
p2p_launch verl.experimental.one_step_off_policy.main_ppo --config-name=one_step_off_ppo_trainer \
    "hydra.searchpath=[pkg://verl.trainer.config,file://$P2P_ROOT/conf]" +p2p=fsdp \
    "${ARGS[@]}" "${P2P_OVERRIDES[@]}" "$@"

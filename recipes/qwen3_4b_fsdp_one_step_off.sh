#!/usr/bin/env bash
# GRPO, Qwen3-4B, one node of 8 GPUs: verl one_step_off_policy, FSDP2 trainer (verl's default) on 4 GPUs, 4 SGLang
# replicas (TP=1) on the other 4, weights synced with checkpoint_engine.backend=verl_p2p through verl_p2p's manager
# (P2P_MANAGER=engine: verl's stock manager). Every FSDP rank streams verl's full tensors and writes its share of
# every rollout rank (conf/p2p/fsdp.yaml). See recipes/README.md for the checklist and the toggles.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3-4B}
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
TEST_FILE=${TEST_FILE:-$HOME/data/gsm8k/test.parquet}
CKPTS_DIR=${CKPTS_DIR:-$HOME/ckpts/verl-p2p/qwen3-4b-fsdp-one-step-off}
TRAINER_GPUS=${TRAINER_GPUS:-4}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}

ARGS=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=false
    data.train_files="$TRAIN_FILE"
    data.val_files="$TEST_FILE"
    data.train_batch_size=128
    data.max_prompt_length=1024
    data.max_response_length=2048
    # separate trainer and rollout pools (one_step_off asserts it): p2p writes into standalone SGLang replicas
    actor_rollout_ref.hybrid_engine=false
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.model.use_remove_padding=true
    actor_rollout_ref.model.enable_gradient_checkpointing=true
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.001
    # the HF model next to the FSDP shards at each save (what a user serves; FSDP writes it only when asked)
    actor_rollout_ref.actor.checkpoint.save_contents="['model','optimizer','extra','hf_model']"
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.85
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    rollout.nnodes=1
    rollout.n_gpus_per_node=$ROLLOUT_GPUS
    trainer.nnodes=1
    trainer.n_gpus_per_node=$TRAINER_GPUS
    trainer.project_name=verl-p2p
    trainer.experiment_name=qwen3-4b-fsdp-one-step-off-p2p
    trainer.logger='["console"]'
    trainer.default_local_dir="$CKPTS_DIR"
    trainer.save_freq=-1
    trainer.test_freq=10
    trainer.total_epochs=1
)
p2p_overrides
# one_step_off's own FSDP config (its module's config dir) plus p2p's FSDP overlay from this repository.
p2p_launch verl.experimental.one_step_off_policy.main_ppo --config-name=one_step_off_ppo_trainer \
    "hydra.searchpath=[pkg://verl.trainer.config,file://$P2P_ROOT/conf]" +p2p=fsdp \
    "${ARGS[@]}" "${P2P_OVERRIDES[@]}" "$@"

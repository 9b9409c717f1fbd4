#!/usr/bin/env bash
# GRPO, Qwen3-30B-A3B (MoE) on several nodes: verl one_step_off_policy, Megatron trainer (TP=2 PP=2 EP=8) on
# TRAINER_NODES nodes, SGLang replicas (TP=8, EP=8, one per node) on ROLLOUT_NODES nodes, weights synced with
# checkpoint_engine.backend=verl_p2p over RDMA through verl_p2p's manager. Start Ray on every node first (export
# MOONCAKE_DEVICE on the rollout nodes before `ray start` when they have several NICs), then run this on the head.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3-30B-A3B}
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
TEST_FILE=${TEST_FILE:-$HOME/data/gsm8k/test.parquet}
CKPTS_DIR=${CKPTS_DIR:-$HOME/ckpts/verl-p2p/qwen3-30b-a3b-one-step-off}
TRAINER_NODES=${TRAINER_NODES:-2}
ROLLOUT_NODES=${ROLLOUT_NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

ARGS=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=false
    data.train_files="$TRAIN_FILE"
    data.val_files="$TEST_FILE"
    data.train_batch_size=256
    data.max_prompt_length=2048
    data.max_response_length=4096
    actor_rollout_ref.hybrid_engine=false
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2
    actor_rollout_ref.actor.megatron.expert_model_parallel_size=8
    actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1
    actor_rollout_ref.actor.megatron.param_offload=true
    actor_rollout_ref.actor.megatron.optimizer_offload=true
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2
    actor_rollout_ref.ref.megatron.expert_model_parallel_size=8
    actor_rollout_ref.ref.megatron.param_offload=true
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=8
    actor_rollout_ref.rollout.expert_parallel_size=8
    actor_rollout_ref.rollout.gpu_memory_utilization=0.85
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
    rollout.nnodes=$ROLLOUT_NODES
    rollout.n_gpus_per_node=$GPUS_PER_NODE
    trainer.nnodes=$TRAINER_NODES
    trainer.n_gpus_per_node=$GPUS_PER_NODE
    trainer.project_name=verl-p2p
    trainer.experiment_name=qwen3-30b-a3b-one-step-off-p2p
    trainer.logger='["console"]'
    trainer.default_local_dir="$CKPTS_DIR"
    trainer.save_freq=-1
    trainer.test_freq=10
    trainer.total_epochs=1
)
p2p_overrides
p2p_launch verl.experimental.one_step_off_policy.main_ppo --config-name=one_step_off_ppo_megatron_trainer \
    "hydra.searchpath=[pkg://verl.trainer.config,file://$P2P_ROOT/conf]" +p2p=default \
    "${ARGS[@]}" "${P2P_OVERRIDES[@]}" "$@"

#!/usr/bin/env bash
# GRPO on a tiny local Qwen3, one host of 2 GPUs: verl one_step_off_policy, Megatron actor (TP=1) on one GPU, one
# standalone SGLang replica (TP=1) on the other, every weight sync through checkpoint_engine.backend=p2p (verl_p2p's
# manager), the first one checked bit for bit (CHECK_WEIGHTS=1), Mooncake over TCP. The same overrides as
# qwen3_4b_one_step_off.sh with smaller numbers, plus what a host without transformer_engine and FlashAttention
# needs (verl_p2p.sandbox.te_free; SGLang's triton attention). Model and data: recipes/tiny/make_tiny.py.
# scripts/gpu_grpo_run.sh runs it on the GPU machine with the checks around it. See recipes/README.md.
set -euo pipefail
CHECK_WEIGHTS=${CHECK_WEIGHTS:-1}
P2P_PROTOCOL=${P2P_PROTOCOL:-tcp}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

TINY_DIR=${TINY_DIR:-/tmp/verl-p2p-tiny}
MODEL_PATH=${MODEL_PATH:-$TINY_DIR/model}
TRAIN_FILE=${TRAIN_FILE:-$TINY_DIR/data/train.parquet}
TEST_FILE=${TEST_FILE:-$TINY_DIR/data/val.parquet}
CKPTS_DIR=${CKPTS_DIR:-$TINY_DIR/ckpts}
STEPS=${STEPS:-4}
BATCH=8

# Every process verl starts imports recipes/tiny/tiny_run_setup.py (TE-free Megatron, verl_p2p's INFO lines).
export PYTHONPATH="$P2P_ROOT/recipes/tiny:$P2P_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export VERL_USE_EXTERNAL_MODULES=tiny_run_setup
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled RAY_USAGE_STATS_ENABLED=0
# NVLink multicast stays off on shared multi-GPU hosts (NCCL, PyTorch symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RAY_ENV=ray_kwargs.ray_init.runtime_env.env_vars
MEGATRON=actor_rollout_ref.actor.megatron
SGLANG=actor_rollout_ref.rollout.engine_kwargs.sglang

ARGS=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=false
    data.train_files="$TRAIN_FILE"
    data.val_files="$TEST_FILE"
    data.train_batch_size=$BATCH
    data.max_prompt_length=64
    data.max_response_length=32
    data.dataloader_num_workers=2
    actor_rollout_ref.hybrid_engine=false
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.actor.optim.lr=1e-3
    actor_rollout_ref.actor.ppo_mini_batch_size=$BATCH
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.checkpoint.save_contents="['model']"
    $MEGATRON.tensor_model_parallel_size=1
    $MEGATRON.pipeline_model_parallel_size=1
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.n=4
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.3
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.enforce_eager=true
    actor_rollout_ref.rollout.agent.num_workers=2
    rollout.nnodes=1
    rollout.n_gpus_per_node=1
    reward.num_workers=2
    reward.custom_reward_function.path="$P2P_ROOT/recipes/tiny/reward.py"
    reward.custom_reward_function.name=compute_score
    trainer.nnodes=1
    trainer.n_gpus_per_node=1
    trainer.project_name=verl-p2p
    trainer.experiment_name=tiny-grpo-2gpu-p2p
    trainer.logger='["console","file"]'
    trainer.default_local_dir="$CKPTS_DIR"
    trainer.total_epochs=1
    trainer.total_training_steps=$STEPS
    # HF export of the trainer at step STEPS-1 = the weights the rollout holds after the last sync (one step off)
    trainer.save_freq=$((STEPS > 1 ? STEPS - 1 : 1))
    trainer.test_freq=-1
    trainer.val_before_train=true
    # SGLang 0.5.12 with the kernel wheel stripped of FlashAttention-3/FlashMLA: triton attention, torch sampling
    +$SGLANG.attention_backend=triton
    +$SGLANG.sampling_backend=pytorch
    +$SGLANG.disable_cuda_graph=true
    +$SGLANG.grammar_backend=none
    # Megatron without transformer_engine (verl_p2p.sandbox.te_free.te_free_overrides): BSHD batches, no fusions
    $MEGATRON.use_remove_padding=false
    +$MEGATRON.override_transformer_config.gradient_accumulation_fusion=false
    +$MEGATRON.override_transformer_config.masked_softmax_fusion=false
    +$MEGATRON.override_transformer_config.persist_layer_norm=false
    +$MEGATRON.override_transformer_config.apply_rope_fusion=false
    +$MEGATRON.override_transformer_config.bias_activation_fusion=false
    +$MEGATRON.override_transformer_config.bias_dropout_fusion=false
    +$MEGATRON.override_transformer_config.transformer_impl=local
    # The same in every Ray worker, explicitly (they also inherit this shell's environment)
    "+$RAY_ENV.NCCL_NVLS_ENABLE='0'"
    "+$RAY_ENV.TORCH_SYMM_MEM_DISABLE_MULTICAST='1'"
    "+$RAY_ENV.NVSHMEM_DISABLE_NVLS='1'"
    "+$RAY_ENV.VERL_USE_EXTERNAL_MODULES=tiny_run_setup"
    "+$RAY_ENV.HF_HUB_OFFLINE='1'"
    # a named namespace: scripts/grpo_check.py finds the rollout's server actor from beside the run
    +ray_kwargs.ray_init.namespace=verl_p2p_tiny
)
p2p_overrides
p2p_launch verl.experimental.one_step_off_policy.main_ppo --config-name=one_step_off_ppo_megatron_trainer \
    "hydra.searchpath=[pkg://verl.trainer.config,file://$P2P_ROOT/conf]" +p2p=default \
    "${ARGS[@]}" "${P2P_OVERRIDES[@]}" "$@"

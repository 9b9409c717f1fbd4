# The GRPO task every Qwen3-4B recipe runs (one node: 4 trainer GPUs, 4 rollout GPUs), whatever its trainer (Megatron
# or FSDP2) and verl loop (one_step_off or v1 separate_async): model, data, algorithm, the actor's optimizer and the
# rollout's sampling. Each recipe sources it after common.sh and adds its trainer's and loop's own settings to
# QWEN3_4B_GRPO_ARGS (the batch sizes too: separate_async derives them from its parameter_sync_step).
MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3-4B}
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
TEST_FILE=${TEST_FILE:-$HOME/data/gsm8k/test.parquet}
TRAINER_GPUS=${TRAINER_GPUS:-4}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}

QWEN3_4B_GRPO_ARGS=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=false
    data.train_files="$TRAIN_FILE"
    data.val_files="$TEST_FILE"
    data.max_prompt_length=1024
    data.max_response_length=2048
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.85
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    trainer.nnodes=1
    trainer.n_gpus_per_node=$TRAINER_GPUS
    trainer.project_name=verl-p2p
    trainer.logger='["console"]'
    trainer.save_freq=-1
    trainer.test_freq=10
    trainer.total_epochs=1
)

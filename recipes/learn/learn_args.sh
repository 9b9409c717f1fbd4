# shellcheck shell=bash
# Shared by the learning recipes (learn_grpo.sh: one_step_off; learn_fully_async.sh: fully_async): the task
# (recipes/learn/reward.py's target words, data by recipes/learn/make_learn.py) and its GRPO settings, the same
# seeds for every backend. Sets LEARN_ARGS (Hydra overrides, appended after tiny/tiny_args.sh's TINY_ARGS). Source
# after tiny/tiny_args.sh. These values made the curves of docs/measurements/grpo_h100_learn_one_step_off.md
# (40 steps); recipes/README.md says what each is for.
#
# Environment (all optional):
#   SEED (1)              data order, Megatron init of the actor's RNG, rollout and SGLang sampling seeds
#   LR (1e-3)             the actor's Adam learning rate
#   GROUP (8)             GRPO group: samples per prompt (rollout.n)
#   RESPONSE_LENGTH (16)  response tokens
#   TEMPERATURE (1.0)     rollout sampling temperature (validation is greedy, verl's default)

SEED=${SEED:-1}
LR=${LR:-1e-3}
GROUP=${GROUP:-8}
RESPONSE_LENGTH=${RESPONSE_LENGTH:-16}
TEMPERATURE=${TEMPERATURE:-1.0}

LEARN_ARGS=(
    reward.custom_reward_function.path="$P2P_ROOT/recipes/learn/reward.py"
    reward.custom_reward_function.name=compute_score
    actor_rollout_ref.actor.optim.lr=$LR
    actor_rollout_ref.rollout.n=$GROUP
    actor_rollout_ref.rollout.temperature=$TEMPERATURE
    data.max_response_length=$RESPONSE_LENGTH
    # BATCH prompts x GROUP samples per step, in micro batches of 16
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
    # the same seeds for every backend: the curves differ only by the sync
    data.seed=$SEED
    actor_rollout_ref.actor.data_loader_seed=$SEED
    actor_rollout_ref.rollout.seed=$SEED
    +actor_rollout_ref.rollout.engine_kwargs.sglang.random_seed=$SEED
)
# the actor's model-init seed lives in its trainer's own section (TRAINER: tiny/tiny_args.sh)
if [[ "${TRAINER:-megatron}" == fsdp ]]; then
    LEARN_ARGS+=(actor_rollout_ref.actor.fsdp_config.seed=$SEED)
else
    LEARN_ARGS+=(actor_rollout_ref.actor.megatron.seed=$SEED)
fi

#!/usr/bin/env bash
# GRPO that learns (issue 34): verl one_step_off_policy, Megatron actor (TP=1) on one GPU, one SGLang replica (TP=1)
# on the other, on a task a tiny random-init model learns in minutes with nothing downloaded (recipes/learn/: the
# share of response tokens from a small target set). BACKEND=verl_p2p (default) | mooncake (verl's own engine) |
# control (the negative control: a stand-in engine that never updates the rollout's weights). STEPS (40) training
# steps with fixed seeds (SEED), verl's validation before the first and after the last step. ONE_GPU=1 puts both
# pools on one GPU (the pool-mapping stand-in). Shared settings: tiny/tiny_args.sh, learn/learn_args.sh. Model and
# data: learn/make_learn.py. scripts/gpu_grpo_run.sh TASK=learn runs it on the GPU machine with the checks around it.
set -euo pipefail
CHECK_WEIGHTS=${CHECK_WEIGHTS:-1}
P2P_PROTOCOL=${P2P_PROTOCOL:-tcp}
BACKEND=${BACKEND:-verl_p2p}
TINY_DIR=${TINY_DIR:-/tmp/verl-p2p-learn}
STEPS=${STEPS:-40}
BATCH=${BATCH:-16}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$P2P_ROOT/recipes/tiny/tiny_args.sh"
source "$P2P_ROOT/recipes/learn/learn_args.sh"

ARGS=(
    data.train_batch_size=$BATCH
    trainer.experiment_name=learn-grpo-${BACKEND}
    trainer.total_training_steps=$STEPS
    # verl's validation score (greedy) at the start and at the end
    trainer.val_before_train=true
    trainer.test_freq=$STEPS
)
p2p_launch verl.experimental.one_step_off_policy.main_ppo --config-name="$TINY_ONE_STEP_OFF_CONFIG" \
    "${TINY_SYNC_ARGS[@]}" "${TINY_ARGS[@]}" "${LEARN_ARGS[@]}" "${ARGS[@]}" "$@"

#!/usr/bin/env bash
# GRPO on a tiny local Qwen3: verl one_step_off_policy, Megatron actor (TP=1) on one GPU, one standalone SGLang
# replica (TP=1) on the other, every weight sync through checkpoint_engine.backend=p2p (verl_p2p's manager), the
# first one checked bit for bit (CHECK_WEIGHTS=1), Mooncake over TCP. ONE_GPU=1 puts both pools on one GPU (the
# pool mapping, a stand-in for the second GPU); BACKEND=mooncake|nixl runs the same with verl's own engine;
# RESUME=1 resumes from the latest checkpoint. Shared settings: tiny/tiny_args.sh. Model and data:
# tiny/make_tiny.py. scripts/gpu_grpo_run.sh runs it on the GPU machine with the checks around it.
set -euo pipefail
CHECK_WEIGHTS=${CHECK_WEIGHTS:-1}
P2P_PROTOCOL=${P2P_PROTOCOL:-tcp}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$P2P_ROOT/recipes/tiny/tiny_args.sh"

ARGS=(
    data.train_batch_size=$BATCH
    trainer.experiment_name=tiny-grpo-${BACKEND}
    trainer.total_training_steps=$STEPS
    trainer.val_before_train=true
)
p2p_launch verl.experimental.one_step_off_policy.main_ppo --config-name="$TINY_ONE_STEP_OFF_CONFIG" \
    "${TINY_SYNC_ARGS[@]}" "${TINY_ARGS[@]}" "${ARGS[@]}" "$@"

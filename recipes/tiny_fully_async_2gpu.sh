#!/usr/bin/env bash
# GRPO on the tiny local Qwen3 with verl's fully_async_policy trainer: the rollouter generates continuously on one
# SGLang replica (TP=1) while the Megatron trainer (TP=1) trains; partial rollout is on, so requests are in flight
# when a sync starts (verl aborts them, p2p writes, they resume on the new weights). Every weight sync goes through
# checkpoint_engine.backend=p2p driven by verl's stock CheckpointEngineManager (the engine hooks: fully_async does
# not read checkpoint_manager_class), one sync per training step (trigger_parameter_sync_step=1), the first one
# checked bit for bit. VERSIONS parameter versions (default 6). ONE_GPU=1: both pools on one GPU (stand-in pool
# mapping, tiny/tiny_args.sh). Model and data: tiny/make_tiny.py with --train >= 8 * VERSIONS.
set -euo pipefail
CHECK_WEIGHTS=${CHECK_WEIGHTS:-1}
P2P_PROTOCOL=${P2P_PROTOCOL:-tcp}
VERSIONS=${VERSIONS:-6}
# The rollouter must still be generating when the trainer syncs, or no request is in flight at a sync (verl counts 0
# partial rollouts). verl's rollouter pauses once it is max_required_samples (required x (1 + staleness)) ahead and
# drains every request before the sync, so a rollouter faster than the trainer never has one in flight: at 32
# tokens and at 256 tokens with 16 prompts at a time, every step's samples were done well inside a training step
# (0 partial rollouts at every step, H200). Long responses and 2 prompts at a time (8 requests with rollout.n=4)
# keep the tiny model's generation slower than its training step, so each sync aborts requests and they resume.
RESPONSE_LENGTH=${RESPONSE_LENGTH:-512}
CONCURRENT_SAMPLES=${CONCURRENT_SAMPLES:-2}
STEPS=$VERSIONS
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$P2P_ROOT/recipes/tiny/tiny_args.sh"

ARGS=(
    # one prompt per rollout step; a training step takes ppo_mini_batch_size prompts (x rollout.n samples)
    data.train_batch_size=0
    data.gen_batch_size=1
    rollout.total_rollout_steps=$((BATCH * VERSIONS))
    async_training.trigger_parameter_sync_step=1
    # the LR schedule's length: verl's fully_async trainer builds the actor's optimizer before the rollouter has
    # counted the training steps (set_total_train_steps comes after init_workers), so the optimizer config would
    # keep its placeholder -1 and megatron's scheduler asserts lr_decay_steps > 0 (seen on the H200)
    trainer.total_training_steps=$VERSIONS
    actor_rollout_ref.actor.optim.total_training_steps=$VERSIONS
    async_training.require_batches=1
    async_training.staleness_threshold=0.5
    async_training.partial_rollout=true
    async_training.concurrent_samples_per_replica=$CONCURRENT_SAMPLES
    data.max_response_length=$RESPONSE_LENGTH
    actor_rollout_ref.rollout.calculate_log_probs=true
    actor_rollout_ref.actor.use_rollout_log_probs=true
    # Ray's logical CPU slots: verl's FullyAsyncRollouter actor asks for 10 CPUs, the task runner, trainer, workers,
    # agent and reward loops for more; on a 16-core host the rollouter was never scheduled and the run hung (H200)
    +ray_kwargs.ray_init.num_cpus=${RAY_CPUS:-48}
    trainer.experiment_name=tiny-fully-async-${BACKEND}
    trainer.val_before_train=false
    # verl's validation after the last sync, on the last version's weights: the rollout generates (and lives) after
    # it, so the check beside the run can probe the version it ends with (without it verl shut the rollout down
    # within a tenth of a second of the last sync, before the probe read it: H200)
    trainer.test_freq=$VERSIONS
    # one save, forced at the end (verl saves then whenever save_freq > 0): the last synced version's weights
    trainer.save_freq=1000
)
p2p_launch verl.experimental.fully_async_policy.fully_async_main --config-name="$TINY_FULLY_ASYNC_CONFIG" \
    "${TINY_SYNC_ARGS[@]}" "${TINY_ARGS[@]}" "${ARGS[@]}" "$@"

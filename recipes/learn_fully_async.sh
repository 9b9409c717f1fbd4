#!/usr/bin/env bash
# GRPO that learns (issue 34), verl's fully_async_policy trainer with partial rollouts on, weights synced by p2p:
# recipes/tiny_fully_async_2gpu.sh (one sync per training step, the first checked bit for bit, verl's validation
# after the last sync) on the learning task of recipes/learn/ (the share of response tokens from a small target
# set) with learn/learn_args.sh's settings and seeds appended (they win). VERSIONS (60) parameter versions. The
# rollouter must still be generating when a sync starts (partial rollouts), so responses are longer than the
# one_step_off run's (RESPONSE_LENGTH 64) and CONCURRENT_SAMPLES (2) prompts run at a time: starting points, to be
# tuned on the H200 with the learning rate. BACKEND=verl_p2p (default) | mooncake | control as in learn_grpo.sh.
set -euo pipefail
P2P_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export BACKEND=${BACKEND:-verl_p2p}
export TINY_DIR=${TINY_DIR:-/tmp/verl-p2p-learn}
export VERSIONS=${VERSIONS:-60}
export BATCH=${BATCH:-16}
export RESPONSE_LENGTH=${RESPONSE_LENGTH:-64}
export CONCURRENT_SAMPLES=${CONCURRENT_SAMPLES:-2}
source "$P2P_ROOT/recipes/learn/learn_args.sh"
exec bash "$P2P_ROOT/recipes/tiny_fully_async_2gpu.sh" "${LEARN_ARGS[@]}" \
    trainer.experiment_name="learn-fully-async-${BACKEND}" "$@"

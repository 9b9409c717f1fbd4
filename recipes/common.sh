# shellcheck shell=bash
# Shared by the p2p GRPO recipes: paths, the p2p toggles, and the launcher.
#
# Environment (all optional):
#   MODEL_PATH, TRAIN_FILE, TEST_FILE, CKPTS_DIR   model and GSM8K-style parquet data
#   P2P_PROTOCOL=rdma|tcp        Mooncake transport: engine_kwargs.verl_p2p.protocol, set once (the conf's
#                                callback hands it to the rollout servers as MOONCAKE_PROTOCOL)
#   P2P_DEVICE_NAME=mlx5_0,...   trainer-side RDMA NIC(s); the rollout side reads MOONCAKE_DEVICE
#   CHECK_WEIGHTS=1              check_weight_update_equal: the first sync must reproduce the rollout's
#                                checkpoint bit for bit (rollout loads real weights; no resume unless RESUME=1,
#                                when the check is skipped: a resumed trainer's weights differ by design)
#   P2P_MANAGER=engine           use verl's stock CheckpointEngineManager (engine hooks only) instead of
#                                verl_p2p's manager (matters for one_step_off; v1 always uses the stock one)
#   P2P_PRINT_COMMAND=1          print the python arguments (NUL-separated) instead of running them

P2P_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
export MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
export HYDRA_FULL_ERROR=1

P2P_KWARGS=actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.verl_p2p

# Overrides every recipe adds after its own.
p2p_overrides() {
    # the protocol once: conf/p2p/default.yaml forwards it to the Ray workers as MOONCAKE_PROTOCOL (its Hydra
    # callback resolves the interpolation before verl's run_ppo hands ray_init to ray.init)
    P2P_OVERRIDES=("${P2P_KWARGS}.protocol=${P2P_PROTOCOL:-rdma}")
    if [[ -n "${P2P_DEVICE_NAME:-}" ]]; then
        P2P_OVERRIDES+=("${P2P_KWARGS}.device_name=${P2P_DEVICE_NAME}")
    fi
    if [[ "${CHECK_WEIGHTS:-0}" == 1 ]]; then
        P2P_OVERRIDES+=(
            "${P2P_KWARGS}.check_weight_update_equal=true"
            actor_rollout_ref.rollout.load_format=auto
        )
        # a resumed trainer's weights differ from the checkpoint by design: the check then runs in its resumed
        # mode (skipped, logged); otherwise resuming is off so the first sync really is checked
        [[ "${RESUME:-0}" == 1 ]] || P2P_OVERRIDES+=(trainer.resume_mode=disable)
    fi
    if [[ "${P2P_MANAGER:-p2p}" == engine ]]; then
        P2P_OVERRIDES+=(actor_rollout_ref.rollout.checkpoint_manager_class=null)
    fi
}

# p2p_launch <python module> <args...>: run it, or print the arguments for tests (P2P_PRINT_COMMAND=1).
p2p_launch() {
    if [[ "${P2P_PRINT_COMMAND:-0}" == 1 ]]; then
        printf '%s\0' "$@"
        return 0
    fi
    exec "$PYTHON" -m "$@"
}

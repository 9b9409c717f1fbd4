# shellcheck shell=bash
# Shared by the tiny GRPO recipes (tiny_grpo_2gpu.sh: one_step_off; tiny_fully_async_2gpu.sh: fully_async): the
# model and data, the TE-free Megatron, SGLang's kernel choices, the Ray workers' environment, the pool mapping and
# the weight-sync backend. Sets TINY_ARGS (Hydra overrides) and TINY_SYNC_ARGS (the backend's). Source after
# common.sh.
#
# Environment (all optional):
#   ONE_GPU=1                both pools on ONE GPU (a stand-in for the second GPU, named as one): Ray is told the
#                            node has 2 GPUs and every process it starts is mapped onto the one physical device
#                            (tiny/tiny_run_setup.py); without it the run needs 2 GPUs, one per pool
#   TRAINER=megatron|fsdp    verl's actor: Megatron (default; TE-free, TP1) or FSDP2 (verl's default trainer; HF
#                            model with SDPA attention, p2p's +p2p=fsdp overlay); sets TINY_ONE_STEP_OFF_CONFIG and
#                            TINY_FULLY_ASYNC_CONFIG, the verl config each recipe starts from
#   FSDP_STRATEGY=fsdp2|fsdp  with TRAINER=fsdp: FSDP2 (fully_shard, default) or FSDP1 (FullyShardedDataParallel)
#   PARAM_OFFLOAD=1          with TRAINER=fsdp: verl's param offload (the actor's parameters live in host memory
#                            between phases; its weight stream loads them to the GPU and offloads them again)
#   BACKEND=p2p|mooncake|nixl|control weight sync: p2p (this package, default; also `verl_p2p`), verl's own engine,
#                            or the negative control (recipes/learn/control_engine.py, a stand-in that never
#                            updates the rollout's weights), same run otherwise
#   STEPS, SAVE_FREQ, RESUME=1  training steps; save every SAVE_FREQ steps (default STEPS-1); resume from the latest
#                            checkpoint in CKPTS_DIR (the weight check then runs in its resumed mode: skipped)
#   SAVE_CONTENTS            what a save holds (default the HF model only)

TINY_DIR=${TINY_DIR:-/tmp/verl-p2p-tiny}
MODEL_PATH=${MODEL_PATH:-$TINY_DIR/model}
TRAIN_FILE=${TRAIN_FILE:-$TINY_DIR/data/train.parquet}
TEST_FILE=${TEST_FILE:-$TINY_DIR/data/val.parquet}
CKPTS_DIR=${CKPTS_DIR:-$TINY_DIR/ckpts}
STEPS=${STEPS:-4}
SAVE_FREQ=${SAVE_FREQ:-$((STEPS > 1 ? STEPS - 1 : 1))}
BACKEND=${BACKEND:-p2p}
BATCH=${BATCH:-8}
# what a save writes: the HF model (the fresh-server comparison reads it, and it is what a user serves). Megatron's
# 'model' save holds an HF export (actor/model/huggingface); FSDP's holds shards only and writes the HF model
# (actor/huggingface) when 'hf_model' is asked for. A run to be resumed also needs 'optimizer' and 'extra'.
if [[ "${TRAINER:-megatron}" == fsdp ]]; then
    SAVE_CONTENTS=${SAVE_CONTENTS:-"['model','hf_model']"}
else
    SAVE_CONTENTS=${SAVE_CONTENTS:-"['model']"}
fi

# Every process verl starts imports recipes/tiny/tiny_run_setup.py (TE-free Megatron, verl_p2p's INFO lines, the
# one-GPU mapping).
export PYTHONPATH="$P2P_ROOT/recipes/tiny:$P2P_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export VERL_USE_EXTERNAL_MODULES=tiny_run_setup
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled RAY_USAGE_STATS_ENABLED=0
# NVLink multicast stays off on shared multi-GPU hosts (NCCL, PyTorch symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RAY_ENV=ray_kwargs.ray_init.runtime_env.env_vars
MEGATRON=actor_rollout_ref.actor.megatron
SGLANG=actor_rollout_ref.rollout.engine_kwargs.sglang
TRAINER=${TRAINER:-megatron}
case "${FSDP_STRATEGY:-fsdp2}" in
    fsdp2 | fsdp) ;;
    *)
        echo "FSDP_STRATEGY=$FSDP_STRATEGY: expected fsdp2 (FSDP2) or fsdp (FSDP1)" >&2
        exit 2
        ;;
esac
case "$TRAINER" in
    megatron) TINY_ONE_STEP_OFF_CONFIG=one_step_off_ppo_megatron_trainer TINY_FULLY_ASYNC_CONFIG=fully_async_ppo_megatron_trainer ;;
    fsdp) TINY_ONE_STEP_OFF_CONFIG=one_step_off_ppo_trainer TINY_FULLY_ASYNC_CONFIG=fully_async_ppo_trainer ;;
    *)
        echo "TRAINER=$TRAINER: expected megatron or fsdp" >&2
        exit 2
        ;;
esac

TINY_ARGS=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=false
    data.train_files="$TRAIN_FILE"
    data.val_files="$TEST_FILE"
    data.max_prompt_length=64
    data.max_response_length=32
    data.dataloader_num_workers=2
    actor_rollout_ref.hybrid_engine=false
    actor_rollout_ref.model.path="$MODEL_PATH"
    # BSHD batches (the TE-free Megatron has no packed-sequence attention; FSDP's packed path needs flash-attn,
    # which the GPU stack does not carry)
    actor_rollout_ref.model.use_remove_padding=false
    actor_rollout_ref.actor.optim.lr=1e-3
    actor_rollout_ref.actor.ppo_mini_batch_size=$BATCH
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.checkpoint.save_contents="$SAVE_CONTENTS"
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
    trainer.logger='["console","file"]'
    trainer.default_local_dir="$CKPTS_DIR"
    trainer.total_epochs=1
    trainer.save_freq=$SAVE_FREQ
    trainer.test_freq=-1
    # SGLang 0.5.12 with the kernel wheel stripped of FlashAttention-3/FlashMLA: triton attention, torch sampling
    +$SGLANG.attention_backend=triton
    +$SGLANG.sampling_backend=pytorch
    +$SGLANG.disable_cuda_graph=true
    +$SGLANG.grammar_backend=none
    # The same in every Ray worker, explicitly (they also inherit this shell's environment)
    "+$RAY_ENV.NCCL_NVLS_ENABLE='0'"
    "+$RAY_ENV.TORCH_SYMM_MEM_DISABLE_MULTICAST='1'"
    "+$RAY_ENV.NVSHMEM_DISABLE_NVLS='1'"
    "+$RAY_ENV.VERL_USE_EXTERNAL_MODULES=tiny_run_setup"
    "+$RAY_ENV.HF_HUB_OFFLINE='1'"
    # a named namespace: scripts/grpo_check.py finds the rollout's server actor from beside the run
    +ray_kwargs.ray_init.namespace=verl_p2p_tiny
)

if [[ "${RESUME:-0}" == 1 ]]; then
    TINY_ARGS+=(trainer.resume_mode=auto)
fi

# The actor's own settings. Megatron: the ref worker reads the model's flag, the actor its megatron config.
if [[ "$TRAINER" == megatron ]]; then
    TINY_ARGS+=(
        $MEGATRON.use_remove_padding=false
        $MEGATRON.tensor_model_parallel_size=1
        $MEGATRON.pipeline_model_parallel_size=1
        actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1
        # Megatron without transformer_engine (verl_p2p.sandbox.te_free.te_free_overrides): no fusions, local layers
        +$MEGATRON.override_transformer_config.gradient_accumulation_fusion=false
        +$MEGATRON.override_transformer_config.masked_softmax_fusion=false
        +$MEGATRON.override_transformer_config.persist_layer_norm=false
        +$MEGATRON.override_transformer_config.apply_rope_fusion=false
        +$MEGATRON.override_transformer_config.bias_activation_fusion=false
        +$MEGATRON.override_transformer_config.bias_dropout_fusion=false
        +$MEGATRON.override_transformer_config.transformer_impl=local
    )
else  # FSDP2: verl's HF model with SDPA (verl's default asks for flash-attn), no torch.compile of the tiny model
    TINY_ARGS+=(
        actor_rollout_ref.actor.strategy="${FSDP_STRATEGY:-fsdp2}"
        +actor_rollout_ref.model.override_config.attn_implementation=sdpa
        actor_rollout_ref.actor.use_torch_compile=false
    )
    [[ "${PARAM_OFFLOAD:-0}" == 1 ]] && TINY_ARGS+=(actor_rollout_ref.actor.fsdp_config.param_offload=true)
fi

# The pool mapping (stand-in): Ray starts with two GPU slots on a one-GPU node; tiny_run_setup.py maps the slot Ray
# hands a worker onto the one device. Ray refuses num_gpus=2 while the driver's CUDA_VISIBLE_DEVICES names one GPU.
if [[ "${ONE_GPU:-0}" == 1 ]]; then
    unset CUDA_VISIBLE_DEVICES
    # Ray runs the hook in every worker before its first task: the mapping is in place before anything in that
    # process asks for CUDA (the CUDA runtime reads CUDA_VISIBLE_DEVICES once, at its first use)
    TINY_ARGS+=(+ray_kwargs.ray_init.num_gpus=2 "+$RAY_ENV.VERL_P2P_ONE_GPU='1'"
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=tiny_run_setup.ray_worker_setup)
fi

# The weight-sync backend. p2p: this package's overlay and toggles (common.sh). verl's own engines: the same run
# with verl's stock manager; Mooncake is told to use TCP where the host has no RDMA NIC (verl's engine asks for rdma).
[[ "$BACKEND" == verl_p2p ]] && BACKEND=p2p  # the backend's registered name, as the learning runs report it
case "$BACKEND" in
    p2p)
        p2p_overrides
        overlay=default
        [[ "$TRAINER" == fsdp ]] && overlay=fsdp  # conf/p2p/fsdp.yaml: the FSDP source's export
        TINY_SYNC_ARGS=("hydra.searchpath=[pkg://verl.trainer.config,file://$P2P_ROOT/conf]" "+p2p=$overlay"
            "${P2P_OVERRIDES[@]}")
        ;;
    mooncake | nixl | control)
        # verl's own search path (file://verl/trainer/config) resolves only from a verl checkout
        # what p2p's overlay sets for the run: SGLang (verl's config leaves the name mandatory), the rollout
        # loading the checkpoint's real weights, no resume unless asked (a stale checkpoint folder is not picked up),
        # and SGLang's memory saver off (verl turns it on for every server; a standalone rollout keeps its weights,
        # p2p's run has it off, and the H200 stack has no torch_memory_saver: the mooncake run stopped there)
        TINY_SYNC_ARGS=("hydra.searchpath=[pkg://verl.trainer.config]"
            actor_rollout_ref.rollout.checkpoint_engine.backend="$BACKEND"
            actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.load_format=auto
            +actor_rollout_ref.rollout.engine_kwargs.sglang.enable_memory_saver=false)
        [[ "${RESUME:-0}" == 1 ]] || TINY_SYNC_ARGS+=(trainer.resume_mode=disable)
        if [[ "$BACKEND" == control ]]; then  # the stand-in engine: verl imports it in every process, registering it
            export PYTHONPATH="$P2P_ROOT/recipes/learn:$PYTHONPATH"
            TINY_SYNC_ARGS+=(actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=control_engine)
        fi
        if [[ "$BACKEND" == mooncake && "${P2P_PROTOCOL:-tcp}" == tcp ]]; then
            export MC_FORCE_TCP=1
            TINY_SYNC_ARGS+=("+$RAY_ENV.MC_FORCE_TCP='1'")
        fi
        ;;
    *)
        echo "BACKEND=$BACKEND: expected p2p (or verl_p2p), mooncake, nixl or control" >&2
        exit 2
        ;;
esac

#!/usr/bin/env bash
# One tiny GRPO run on the H200 machine, in one device call (at most 10 minutes), with the checks around it:
#   1. unpack the stack carried in earlier calls (scripts/gpu_wheels.sh parts in $STACK, default /tmp/stack; a part
#      this call carries in .gpu-grpo/ is copied there first),
#   2. write the model and data (recipes/tiny/make_tiny.py; SHAPE=tiny|qwen3-4b, LAYERS) unless KEEP_TINY=1,
#   3. run the recipe (RUN=one_step_off: recipes/tiny_grpo_2gpu.sh; RUN=fully_async: recipes/tiny_fully_async_2gpu.sh)
#      with scripts/grpo_check.py beside it: `probe` records the rollout's greedy output and checksums at each
#      weight version; `fresh` starts a plain SGLang server on the trainer's HF export of step FRESH_STEP and
#      compares it with the rollout's version holding those weights (one_step_off: FRESH_STEP+1; fully_async: the
#      same number, its forced last save),
#   4. write $OUT/summary.json (scripts/grpo_check.py summary).
# On a machine with one GPU both pools share it (ONE_GPU=1, the pool-mapping stand-in; set by default when
# nvidia-smi lists one GPU). DATA_STEPS=N: write data for an N-step run (the first run of a save/resume pair).
# RESUME_FROM=N: resume from the step-N checkpoint of the previous run (copied to a fresh checkpoint folder, so the
# new run's exports do not mix with the old ones); the weight check then expects `skipped`. Everything under $OUT comes back: setup.log run.log metrics.jsonl probe.json compare.json
# fresh_server.log summary.json (PACK=1: summary.json and logs.tgz of the rest, for several runs in one call).
# TASK=learn: the learning runs of issue 34 (recipes/learn_grpo.sh, recipes/learn_fully_async.sh; model and data by
# recipes/learn/make_learn.py in /tmp/verl-p2p-learn; STEPS default 60, BATCH 16 prompts a step), one command per run:
#   TASK=learn BACKEND=verl_p2p|mooncake|control [RUN=fully_async] bash scripts/gpu_grpo_run.sh
# BACKEND=control is the negative control (recipes/learn/control_engine.py, a stand-in that never writes the
# rollout's weights): its summary requires the rollout to DIFFER from a fresh server on the trainer's export.
# Exit 0 only when the summary's "ok" is true. Arguments: extra Hydra overrides.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/private_dir.sh
OUT=${OUT:-$(mktemp -d)}
# STACK, $SITE_ROOT/site and TINY_DIR last across device calls (carried parts, the unpacked stack, a kept model with
# KEEP_TINY=1): fixed names, checked private below (scripts/private_dir.sh)
STACK=${STACK:-/tmp/stack}
SITE_ROOT=${SITE_ROOT:-/tmp}  # the stack unpacks to $SITE_ROOT/site
RUN=${RUN:-one_step_off}
TASK=${TASK:-tiny}
SHAPE=${SHAPE:-tiny}
case "$TASK" in
    tiny)  # the transfer checks' task (recipes/tiny/): 8 prompts a step
        STEPS=${STEPS:-4} BATCH=${BATCH:-8} TINY_DIR=${TINY_DIR:-/tmp/verl-p2p-tiny}
        one_step_off_recipe=recipes/tiny_grpo_2gpu.sh fully_async_recipe=recipes/tiny_fully_async_2gpu.sh
        make_data=(recipes/tiny/make_tiny.py --shape "$SHAPE" ${LAYERS:+--layers "$LAYERS"})
        ;;
    learn)  # issue 34's learning task (recipes/learn/): the tiny shape only
        STEPS=${STEPS:-40} BATCH=${BATCH:-16} TINY_DIR=${TINY_DIR:-/tmp/verl-p2p-learn}
        one_step_off_recipe=recipes/learn_grpo.sh fully_async_recipe=recipes/learn_fully_async.sh
        make_data=(recipes/learn/make_learn.py --seed "${SEED:-1}")
        ;;
    *)
        echo "TASK=$TASK: expected tiny or learn" >&2
        exit 2
        ;;
esac
export BATCH
private_dir "$STACK" STACK || exit 2
private_dir "$SITE_ROOT/site" SITE_ROOT || exit 2
private_dir "$TINY_DIR" TINY_DIR || exit 2
BUDGET_S=${BUDGET_S:-570}  # whole script, inside the device's 600 s
mkdir -p "$OUT"
start=$SECONDS
left() { echo $((BUDGET_S - (SECONDS - start))); }
# the parts of one xz'd tar of site/ (scripts/gpu_wheels.sh), in order, unpacked under $SITE_ROOT
unpack_parts() {
    cat "$@" | python3 -c 'import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1], filter="tar")' "$SITE_ROOT"
}

# NVLink multicast stays off on that machine (NCCL, PyTorch symmetric memory, NVSHMEM): every process below.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$SITE_ROOT/site:$root" CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
# memory on that machine grows as it is used (MemTotal reads small at first): no Ray OOM killer on stale numbers
export RAY_memory_monitor_refresh_ms=0
export TINY_DIR STEPS VERL_FILE_LOGGER_PATH="$OUT/metrics.jsonl"
export CKPTS_DIR=${CKPTS_DIR:-$TINY_DIR/ckpts}
if [[ -z "${ONE_GPU:-}" ]]; then
    ONE_GPU=$([[ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" == 1 ]] && echo 1 || echo 0)
fi
export ONE_GPU

case "$RUN" in
    one_step_off)
        recipe=$one_step_off_recipe mode=one_step_off
        FRESH_STEP=${FRESH_STEP:-$((STEPS - 1))} FINAL_VERSION=${FINAL_VERSION:-$STEPS}
        FRESH_VERSION=$((FRESH_STEP + 1))  # one step off: the sync after step N writes N's weights as version N+1
        # one_step_off prefetches a batch: a run needs data past its last step; DATA_STEPS: the steps of the run
        # that will resume from this one's checkpoint (KEEP_TINY=1 keeps this data)
        rows=$((BATCH * ${DATA_STEPS:-$STEPS} + 2 * BATCH))
        ;;
    fully_async)
        recipe=$fully_async_recipe mode=fully_async
        export VERSIONS=$STEPS
        # the run's last save (forced at the end) is of the parameter version the rollout was synced to last
        FRESH_STEP=${FRESH_STEP:-$STEPS} FINAL_VERSION=${FINAL_VERSION:-$STEPS} FRESH_VERSION=$FRESH_STEP
        rows=$((BATCH * ${DATA_STEPS:-$STEPS} + BATCH))
        ;;
    *)
        echo "RUN=$RUN: expected one_step_off or fully_async" >&2
        exit 2
        ;;
esac
expect_check=passed version_from=sglang
if [[ -n "${RESUME_FROM:-}" ]]; then
    export RESUME=1
    expect_check=skipped
fi
BACKEND=${BACKEND:-p2p}
[[ "$BACKEND" == verl_p2p ]] && BACKEND=p2p  # the registered name; the recipes and the summary say p2p
export BACKEND
if [[ "$BACKEND" != p2p ]]; then  # verl's own engine or the control: no p2p check, verl counts the versions
    expect_check=none version_from=verl
fi

(
    echo "== unpack $(date -u +%T)"
    if compgen -G ".gpu-grpo/part.*" >/dev/null; then  # a part carried by this very call
        mkdir -p "$STACK" && cp .gpu-grpo/part.* "$STACK"/
    fi
    if [[ ! -d "$SITE_ROOT/site/verl" ]]; then
        ls -la "$STACK"/part.* || { echo "no stack parts in $STACK (carry scripts/gpu_wheels.sh's parts first)"; exit 2; }
        unpack_parts "$STACK"/part.* || exit 2
    fi
    # NIXL for BACKEND=nixl (scripts/gpu_wheels.sh --nixl: one part, carried in a call of its own or with a run)
    if compgen -G ".gpu-nixl/part.*" >/dev/null && [[ ! -d "$SITE_ROOT/site/nixl" ]]; then
        unpack_parts .gpu-nixl/part.* || exit 2
    fi
    if [[ "${BACKEND:-p2p}" == nixl ]]; then
        python3 -c 'import nixl._api, nixl._bindings' || { echo "BACKEND=nixl: carry .gpu-nixl/part.aa"; exit 3; }
    fi
    echo "== imports $(date -u +%T)"
    nvidia-smi -L
    python3 - <<'EOF' || exit 3
import importlib.metadata as md, torch
import verl, ray, sglang, megatron.core, transformers, tokenizers, hydra  # noqa: F401
from mooncake.engine import TransferEngine  # noqa: F401
import verl.trainer.main_ppo, verl.experimental.one_step_off_policy.main_ppo  # noqa: F401
import verl_p2p.backend.engine, verl_p2p.backend.manager  # noqa: F401
print({n: md.version(n) for n in ("verl", "ray", "sglang", "megatron-core", "megatron-bridge", "megatron-energon",
       "transformers", "tokenizers", "torch", "mooncake-transfer-engine-cuda13")}, "gpus:", torch.cuda.device_count())
EOF
    if [[ "${KEEP_TINY:-0}" == 1 && -f "$TINY_DIR/data/train.parquet" ]]; then  # kept data must last the run
        have=$(python3 -c 'import sys, pyarrow.parquet as pq; print(pq.ParquetFile(sys.argv[1]).metadata.num_rows)' \
            "$TINY_DIR/data/train.parquet") || exit 4
        if ((have < rows)); then
            echo "KEEP_TINY=1: $TINY_DIR/data/train.parquet has $have rows, this run needs $rows (8 per step and a" \
                "prefetched batch): give the first run DATA_STEPS=$STEPS"
            exit 4
        fi
    fi
    if [[ "${KEEP_TINY:-0}" != 1 || ! -d "$TINY_DIR/model" ]]; then
        echo "== model and data: ${make_data[*]} $(date -u +%T)"
        rm -rf "$TINY_DIR"
        python3 "${make_data[0]}" "$TINY_DIR" --train "$rows" "${make_data[@]:1}" || exit 4
    fi
    if [[ -n "${RESUME_FROM:-}" ]]; then  # the previous run's checkpoint of step RESUME_FROM, alone in a new folder
        src="$CKPTS_DIR/global_step_$RESUME_FROM"
        [[ -d "$src" ]] || { echo "no checkpoint $src to resume from"; exit 5; }
        rm -rf "$CKPTS_DIR.resumed" && mkdir -p "$CKPTS_DIR.resumed" && cp -a "$src" "$CKPTS_DIR.resumed/" || exit 5
        echo "$RESUME_FROM" >"$CKPTS_DIR.resumed/latest_checkpointed_iteration.txt"
    fi
    echo "== ready after $((SECONDS - start)) s (ONE_GPU=$ONE_GPU)"
) >"$OUT/setup.log" 2>&1 || { echo "setup failed: see setup.log"; tail -40 "$OUT/setup.log"; exit 1; }
cat "$OUT/setup.log"
[[ -n "${RESUME_FROM:-}" ]] && export CKPTS_DIR="$CKPTS_DIR.resumed"

done_file="$TINY_DIR/run.done"
rm -f "$done_file"
python3 scripts/grpo_check.py probe --out "$OUT/probe.json" --version-from "$version_from" --timeout "$(left)" \
    >/dev/null 2>&1 &
probe_pid=$!
python3 scripts/grpo_check.py fresh --ckpts "$CKPTS_DIR" --step "$FRESH_STEP" --version "$FRESH_VERSION" \
        --probe "$OUT/probe.json" --done-file "$done_file" --out "$OUT/compare.json" --log "$OUT/fresh_server.log" \
        --timeout "$(($(left) - 10))" >/dev/null 2>&1 &
fresh_pid=$!

echo "== run $RUN (limit $(($(left) - 60)) s) $(date -u +%T)"
timeout -k 10 $(($(left) - 60)) bash "$recipe" "$@" >"$OUT/run.log" 2>&1
rc=$?
touch "$done_file"
echo "== run exit $rc after $((SECONDS - start)) s"
kill -TERM "$probe_pid" 2>/dev/null
wait "$probe_pid"
wait "$fresh_pid"
echo "== compare done after $((SECONDS - start)) s"

python3 scripts/grpo_check.py summary --log "$OUT/run.log" --metrics "$OUT/metrics.jsonl" --probe "$OUT/probe.json" \
    --compare "$OUT/compare.json" --steps "$STEPS" --rc "$rc" --out "$OUT/summary.json" --mode "$mode" \
    --expect-check "$expect_check" --backend "$BACKEND" ${FINAL_VERSION:+--final-version "$FINAL_VERSION"}
ok=$?
# files come back up to 16 MiB each: keep the head (config, start-up) and the tail (steps) of a long log
for f in "$OUT/run.log" "$OUT/fresh_server.log"; do
    if [[ -f "$f" && $(stat -c %s "$f") -gt 15000000 ]]; then
        { head -c 3000000 "$f"; printf '\n[... cut ...]\n'; tail -c 11000000 "$f"; } >"$f.cut" && mv "$f.cut" "$f"
    fi
done
grep -E "step:[0-9]+ - |check_weight_update_equal|p2p sync to version|Traceback|Error" "$OUT/run.log" | cut -c1-400 | tail -30
if [[ "${PACK:-0}" == 1 ]]; then  # several runs in one call: at most 8 files come back, so one archive per run
    (cd "$OUT" && tar czf logs.tgz --exclude=summary.json --exclude=logs.tgz ./* && find . -type f ! -name summary.json ! -name logs.tgz -delete)
fi
exit $ok

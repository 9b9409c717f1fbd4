#!/usr/bin/env bash
# Issue 35 on one H200: the models p2p exists for at their real widths. One STEP per device call (each must end inside
# the 10-minute call limit); the order and the device minutes of each are in docs/measurements/real_sizes.md.
# The SGLang 0.5.21 stack is installed once per machine start by scripts/gpu_stack_install.sh (as scripts/gpu_e2e.sh
# does with SGLANG_STACK=0.5.21; the earlier calls carry its parts with --copy-only), then reused while the machine
# stays warm. Reports, logs and the server logs go to $OUT.
#
#   bash scripts/gpu_real_sizes.sh dsv3-fp8      # DeepSeek-V3 real widths (dense + MoE layer), block-FP8 rollout
#   bash scripts/gpu_real_sizes.sh qwen3-bf16    # Qwen3-30B-A3B at REAL_SIZES' depth, bf16 rollout, every drill
#   bash scripts/gpu_real_sizes.sh qwen3-fp8     # the same depth, block-FP8 rollout
#   bash scripts/gpu_real_sizes.sh qwen3-bf16-24 # issue 35's floor (24 layers, 31 GB, 9,435 tensors a sync), bf16,
#                                                # one server at a time (the fresh one stops before the one under test)
#   bash scripts/gpu_real_sizes.sh cost DEPTH [QUANTS]   # scripts/cost_growth.py at one depth (JSON grows, PNG redrawn)
#   bash scripts/gpu_real_sizes.sh dry           # any host: print what each step would run (the mem fractions, disk)
#
# The e2e's `--size real` is verl_p2p/e2e/real_sizes.py's REAL_SIZES. The GPU at hand decides the rest
# (`real_sizes.gpu_step`, from nvidia-smi's memory.total; GPU_MIB in the dry step, default the H200's 143771): the
# mem fraction, and for Qwen3-30B-A3B the depth (REAL_SIZES' 15 layers on an H200, fewer on an 80 GB H100, passed
# as `--layers`); a step that does not fit is refused with the arithmetic. Reports are named after the GPU (h200,
# h100).
# An FP8 run writes four checkpoints (bf16 + FP8 of both weight sets): weight set 1 goes to $SHM (host memory)
# through a symlink the e2e's mkdir keeps, since the disk does not hold all four (docs/measurements/real_sizes.md, "Disk").
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
STEP=${1:?usage: gpu_real_sizes.sh dsv3-fp8|qwen3-bf16|qwen3-fp8|qwen3-bf16-24|cost DEPTH [QUANTS]|dry}
shift
source scripts/private_dir.sh
OUT=${OUT:-$(mktemp -d)}
SITE21=${SITE21:-/tmp/site21}  # checked private by scripts/gpu_stack_install.sh
# the e2e's checkpoints and weight set 1 live for one call: fresh private folders (made again with mode 0700 after
# each step's rm -rf); the cost JSON grows call by call in STATE_DIR, a fixed name checked private
WORK=${WORK:-$(mktemp -d)}
SHM=${SHM:-$(mktemp -d -p /dev/shm 2>/dev/null || mktemp -d)}
STATE_DIR=${STATE_DIR:-/tmp/verl-p2p-real-sizes}
trap 'rmdir "$WORK" "$SHM" 2>/dev/null' EXIT  # a step that made nothing there (dry) leaves no empty folder
LIMIT_S=${LIMIT_S:-570}  # the call's 600 s, less the time to bring $OUT back
mkdir -p "$OUT"
py=python3
if [ "$STEP" = dry ]; then
    py=${PYTHON:-.venv/bin/python}
    export PYTHONPATH="$root"
    GPU_MIB=${GPU_MIB:-143771}
    gpu=${GPU_NAME:-h200}
else
    SITE21="$SITE21" bash scripts/gpu_stack_install.sh >"$OUT/install.txt" 2>&1 || {
        tail -30 "$OUT/install.txt"
        exit 3
    }
    export PYTHONPATH="$SITE21:$root" CUDA_HOME=/usr/local/cuda MC_LOG_LEVEL=ERROR PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h[0-9]+' | tr 'A-Z' 'a-z')
    gpu=${gpu:-gpu}
    df -h /tmp /dev/shm | tee "$OUT/disk.txt"
fi

# the depth, mem_fraction_static and weight set 1 bytes of a model and rollout quantization on this GPU, from the
# one-GPU arithmetic (real_sizes.gpu_step)
budget() { # MODEL(deepseek_v3|qwen3_moe) QUANT ONE_SERVER(0|1) -> "mem_fraction weights1_bytes layers", or a refusal
    "$py" - "$1" "$2" "$GPU_MIB" "$3" <<'PY'
import sys
from verl_p2p.e2e.real_sizes import gpu_step, usable_gpu_bytes
gpu_bytes = usable_gpu_bytes(int(sys.argv[3]))
step = gpu_step(sys.argv[1], sys.argv[2], gpu_bytes=gpu_bytes, one_server=sys.argv[4] == "1")
if step.refusal:
    sys.exit(f"does not fit: {step.refusal}")
print(step.mem_fraction, step.weights1_bytes, step.layers)
PY
}

# weight set 1 (and its FP8 copy) into $SHM: refuses when $SHM has no room for them
weights1_to_shm() { # ARCH BYTES
    local need=$2 free
    mkdir -p -m 700 "$SHM" "$WORK" && mkdir -p "$SHM/$1" "$WORK/$1" || return 1
    free=$(df --output=avail -B1 "$SHM" | tail -1)
    if [ "$free" -lt "$need" ]; then
        echo "gpu_real_sizes.sh: $SHM has $((free >> 30)) GiB free, weight set 1 needs $((need >> 30)) GiB;" \
            "mount a larger /dev/shm or set SHM to a folder with room" >&2
        return 1
    fi
    for part in weights1 weights1-fp8; do
        mkdir -p "$SHM/$1/$part" && ln -sfn "$SHM/$1/$part" "$WORK/$1/$part"
    done
}

e2e() { # verl-p2p e2e at the real widths (`--size real`)
    timeout "$LIMIT_S" "$py" -m verl_p2p.e2e.run --rollout sglang --size real --workdir "$WORK" --bucket-mb 512 \
        --transfer-timeout 120 --http-timeout 120 "$@"
}

run_e2e() { # ARCH QUANT NAME ONE_SERVER(0|1) [e2e arguments]
    local arch=$1 quant=$2 name=${3//_GPU_/_${gpu}_} one=$4 fraction bytes layers fp8=() result
    shift 4
    if ! result=$(budget "$arch" "$quant" "$one" 2>"$OUT/budget.err"); then
        echo "$name: $(tail -1 "$OUT/budget.err")" >&2
        [ "$STEP" = dry ] && return 0  # the dry step lists every step, the refused ones on stderr
        exit 2
    fi
    read -r fraction bytes layers <<<"$result"
    [ "$quant" = fp8 ] && fp8=(--fp8)
    [ "$one" = 1 ] && fp8+=(--one-server-at-a-time)
    if [ "$STEP" = dry ]; then
        echo "$name: e2e --models $arch ${fp8[*]} --layers $layers --mem-fraction $fraction" \
            "(weight set 1: $((bytes >> 30)) GiB)"
        return 0
    fi
    rm -rf "$WORK" "$SHM" && mkdir -p -m 700 "$WORK"
    if [ "$quant" = fp8 ] || [ "$one" = 1 ]; then  # the disk holds no four FP8 checkpoints, nor 2 x 31 GB
        weights1_to_shm "$arch" "$bytes" || exit 2
    fi
    e2e --models "$arch" "${fp8[@]}" --layers "$layers" --mem-fraction "$fraction" --syncs 3 --raw-syncs 3 \
        --out "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log"
    local status=${PIPESTATUS[0]}
    tar czf "$OUT/${name}_server_logs.tgz" "$WORK"/*/*.log 2>/dev/null
    rm -rf "$WORK" "$SHM"
    return "$status"
}

case "$STEP" in
dsv3-fp8) run_e2e deepseek_v3 fp8 e2e_GPU_sglang0521_deepseek_v3_real_fp8 0 "$@" ;;
qwen3-bf16) run_e2e qwen3_moe bf16 e2e_GPU_sglang0521_qwen3_30b_a3b_bf16 0 "$@" ;;
qwen3-fp8) run_e2e qwen3_moe fp8 e2e_GPU_sglang0521_qwen3_30b_a3b_fp8 0 "$@" ;;
qwen3-bf16-24) run_e2e qwen3_moe bf16 e2e_GPU_sglang0521_qwen3_30b_a3b_bf16_floor 1 "$@" ;;
cost)
    depth=${1:?cost DEPTH [QUANTS]}
    quants=${2:-bf16,fp8}
    # $OUT starts empty every call: the JSON grows in $STATE_DIR while the machine stays warm, seeded from the
    # committed one after a fresh start, and is copied back with the PNG
    name=cost_growth_${gpu}_qwen3_30b_a3b
    private_dir "$STATE_DIR" STATE_DIR || exit 3
    state=$STATE_DIR/$name.json
    [ -f "$state" ] || [ ! -f "docs/measurements/$name.json" ] || cp "docs/measurements/$name.json" "$state"
    rm -rf "$WORK" && mkdir -p -m 700 "$WORK"
    timeout "$LIMIT_S" "$py" scripts/cost_growth.py --device cuda --width real --rollout sglang --depths "$depth" \
        --quant "$quants" --workdir "$WORK" --out "$state" --png "$OUT/$name.png" --append \
        2>&1 | tee "$OUT/${name}_l$depth.log"
    status=${PIPESTATUS[0]}
    cp "$state" "$OUT/" 2>/dev/null
    rm -rf "$WORK"
    exit "$status"
    ;;
dry)
    for s in "deepseek_v3 fp8 dsv3-fp8 0" "qwen3_moe bf16 qwen3-bf16 0" "qwen3_moe fp8 qwen3-fp8 0" \
        "qwen3_moe bf16 qwen3-bf16-24 1"; do
        # shellcheck disable=SC2086
        run_e2e $s
    done
    "$py" -m verl_p2p.e2e.real_sizes | "$py" -c 'import json, sys; print(json.load(sys.stdin)["largest_qwen3_30b_a3b_depth"])'
    ;;
*)
    echo "gpu_real_sizes.sh: unknown step '$STEP' (dsv3-fp8, qwen3-bf16, qwen3-fp8, qwen3-bf16-24, cost DEPTH [QUANTS]," \
        "dry)" >&2
    exit 2
    ;;
esac

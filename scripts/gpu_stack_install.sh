#!/usr/bin/env bash
# On the H200 machine: install the SGLang 0.5.21 stack that `scripts/gpu_wheels.sh --sglang 0.5.21` builds (plain
# wheels, tar'd and split into DEST/part.*), then check that it imports. Earlier device calls only copy their part
# into $STACK21; the call that carries the last part runs this script (scripts/gpu_e2e.sh does with
# SGLANG_STACK=0.5.21). It copies any part this very call carries (.gpu-stack-0521/part.*, parts.sha256), checks the
# parts against parts.sha256, unpacks and pip-installs the wheels into $SITE21 (once: a warm machine keeps /tmp),
# links sgl_kernel's sm100 ops to sm90 (a process that sees no GPU loads sm100; the H200 is sm90), prints the import
# check and last the line to use: `export PYTHONPATH=$SITE21:<repo>`.
#
# Usage: bash scripts/gpu_stack_install.sh [--dry-run | --copy-only] [--stack DIR] [--site DIR] [--carried DIR]
#   --copy-only the earlier calls: copy the carried part into $STACK21 and say how many of the list are there.
#   --dry-run   on any host (CI): check the part list of --carried (default .gpu-stack-0521) against its
#               parts.sha256 when the parts are there, and print the commands a real run would run; installs nothing.
# Exit: 0 installed and imported; 2 bad arguments; 3 parts missing or damaged; 4 install failed; 5 an import failed.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/private_dir.sh
# both last across device calls (parts carried call by call; the install kept while the machine stays warm): fixed
# names, checked private before anything is copied there or run from there (scripts/private_dir.sh)
STACK21=${STACK21:-/tmp/stack21}
SITE21=${SITE21:-/tmp/site21}
carried=.gpu-stack-0521
dry=0 copy_only=0
while (($#)); do
    case "$1" in
        --dry-run) dry=1 ;;
        --copy-only) copy_only=1 ;;
        --stack) STACK21=${2:?--stack needs a folder} && shift ;;
        --site) SITE21=${2:?--site needs a folder} && shift ;;
        --carried) carried=${2:?--carried needs a folder} && shift ;;
        *)
            echo "gpu_stack_install.sh: unknown argument '$1' (expected --dry-run, --copy-only, --stack, --site," \
                "--carried)" >&2
            exit 2
            ;;
    esac
    shift
done
# Modules the e2e harness needs on both sides: the rollout server, the transfer engine, the trainer. Megatron-Bridge
# is imported as p2p's trainer imports it, with verl_p2p.sandbox's transformer_engine stub (TE does not travel).
# SGLang's model modules for the MLA / GLM families: SGLang skips a module that fails to import and serves the
# architecture through its Transformers backend, so a missing kernel package shows only here.
imports=(torch triton sglang sgl_kernel flashinfer transformers mooncake.engine ray verl megatron.core
    megatron.bridge deep_gemm sglang.srt.models.deepseek_v2 sglang.srt.models.glm4_moe)

run() {  # print, and run unless --dry-run
    echo "+ $*"
    ((dry)) || "$@"
}

# 1. the part list: parts.sha256 names every part; each must be there, whole.
check_parts() {
    local dir=$1 sums="$1/parts.sha256"
    if [[ ! -f "$sums" ]]; then
        echo "no $sums: carry parts.sha256 with a part (scripts/gpu_wheels.sh --sglang 0.5.21 writes it)"
        return 3
    fi
    local missing=0 name
    while read -r _ name; do
        [[ -f "$dir/$name" ]] || { echo "missing $dir/$name: carry it in an earlier call"; missing=1; }
    done <"$sums"
    ((missing)) && return 3
    (cd "$dir" && sha256sum --quiet -c parts.sha256) || { echo "a part in $dir is damaged: carry it again"; return 3; }
    echo "parts ok: $(wc -l <"$sums") in $dir"
}

if ((dry)); then
    echo "dry run: would install $carried's parts via $STACK21 into $SITE21"
    if compgen -G "$carried/part.*" >/dev/null; then
        check_parts "$carried" || exit 3
    else
        echo "no parts in $carried (build them: bash scripts/gpu_wheels.sh --sglang 0.5.21): part check skipped"
    fi
fi

if ((!dry)); then
    private_dir "$STACK21" STACK21 || exit 3
    private_dir "$SITE21" SITE21 || exit 3
fi
if compgen -G "$carried/part.*" >/dev/null || [[ -f "$carried/parts.sha256" ]]; then  # carried by this very call
    run mkdir -p "$STACK21"
    run cp "$carried"/part.* "$carried"/parts.sha256 "$STACK21"/ 2>/dev/null
fi
if ((copy_only)); then
    have=$(compgen -G "$STACK21/part.*" | wc -l)
    echo "$have part(s) in $STACK21 of $(wc -l <"$STACK21/parts.sha256" 2>/dev/null || echo '?') listed"
    exit 0
fi
if [[ ! -f "$SITE21/.installed" ]]; then
    ((dry)) || check_parts "$STACK21" || exit 3
    run rm -rf "$STACK21/wheels" "$SITE21"
    run mkdir -p -m 700 "$STACK21/wheels" "$SITE21"
    echo "+ cat $STACK21/part.* | tar -x -C $STACK21/wheels"
    if ((!dry)); then
        cat "$STACK21"/part.* | tar -x -C "$STACK21/wheels" || { echo "unpacking the parts failed"; exit 3; }
    fi
    echo "+ python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE21 $STACK21/wheels/*.whl"
    if ((!dry)); then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-warn-script-location --target "$SITE21" \
            "$STACK21"/wheels/*.whl || { echo "pip install into $SITE21 failed"; exit 4; }
    fi
    run ln -sfn sm90 "$SITE21/sgl_kernel/sm100"
    run touch "$SITE21/.installed"
fi

export PYTHONPATH="$SITE21:$root" CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
echo "+ python3 - (import ${imports[*]}; print versions)"
if ((!dry)); then
    python3 - "${imports[@]}" <<'PY' || exit 5
import importlib, importlib.metadata as md, sys, time
failed = []
for name in sys.argv[1:]:
    if name == "megatron.bridge":  # imports transformer_engine at module level: as the trainer does, TE stubbed
        from verl_p2p.sandbox.cpu_megatron import install_te_stub

        install_te_stub()
    t0 = time.perf_counter()
    try:
        mod = importlib.import_module(name)
        print(f"ok   {name} {getattr(mod, '__version__', '')} from {getattr(mod, '__file__', '')} "
              f"({time.perf_counter() - t0:.1f}s)")
    except Exception as exc:
        failed.append(name)
        print(f"FAIL {name}: {type(exc).__name__}: {exc}")
dists = ("torch", "triton", "sglang", "sglang-kernel", "transformers", "nvidia-nccl-cu13", "nvidia-cudnn-cu13",
         "mooncake-transfer-engine-cuda13", "verl", "megatron-core", "megatron-bridge")
print({n: md.version(n) for n in dists})
import torch
print("cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version(),
      "cudnn", torch.backends.cudnn.version())
sys.exit(1 if failed else 0)
PY
fi
echo "export PYTHONPATH=$PYTHONPATH"

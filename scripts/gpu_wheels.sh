#!/usr/bin/env bash
# Build, on a networked x86-64 host, everything the H200 device machine lacks for the tiny verl GRPO run
# (recipes/tiny_grpo_2gpu.sh): SGLang 0.5.12 with its CUDA kernels, Mooncake (CUDA 13 build), verl 0.9.1 and its
# runtime needs, Ray, megatron-core and Megatron-Bridge. The device has no network and takes at most 64 MiB per
# call, so the set is installed here into one folder (pip --target, x86-64 manylinux wheels for CPython 3.12),
# pruned, packed as tar.xz and split into parts of at most PART_MIB (48) MiB: a device call carries 64 MiB with the
# working tree (about 4 MB), and a 60 MiB part no longer fit beside it (session 16).
#
# Usage: bash scripts/gpu_wheels.sh [DEST]        (DEST defaults to .gpu-grpo/, git-ignored)
#        bash scripts/gpu_wheels.sh --sglang 0.5.21 [DEST]   (DEST defaults to .gpu-stack-0521/; see build_0521 below)
#        bash scripts/gpu_wheels.sh --nixl [DEST]   (DEST defaults to .gpu-nixl/: NIXL for verl's nixl engine, one
#                                                  part; scripts/gpu_grpo_run.sh unpacks it into the same site)
# Output: DEST/part.aa, part.ab, ...   Carry one part per device call into /tmp/stack, then on the device:
#   cat /tmp/stack/part.* | python3 -c 'import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall("/tmp", filter="tar")'
#   export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda
# (scripts/gpu_grpo_run.sh does exactly that.)
#
# What the device already has (its image 'cuda'): torch 2.11.0+cu130, triton, numpy, pandas, pyarrow, accelerate,
# peft, safetensors, huggingface-hub, aiohttp, uvloop, requests, psutil, msgpack, einops, protobuf, grpcio, click,
# filelock, fsspec, xxhash, pyyaml, tqdm, cloudpickle, jinja2, prometheus-client, tensorboard, sentencepiece ...
# It has transformers 5.17 / tokenizers 0.23, which SGLang 0.5.12 cannot import ('qwen3_asr' registered twice):
# 5.10.4 / 0.22.2 travel here, inside verl 0.9.1's range (>=5.5.3,<5.11,!=5.6.0) and new enough for
# Megatron-Bridge 0.6.2 (imports Exaone4_5_ForConditionalGeneration, which 5.6.0 lacks).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
sglang_version=0.5.12
PART_MIB=${PART_MIB:-48}
nixl=0
if [[ "${1:-}" == --nixl ]]; then
    nixl=1
    shift
elif [[ "${1:-}" == --sglang ]]; then
    sglang_version=${2:?--sglang needs a version: 0.5.12 or 0.5.21}
    shift 2
fi
case "$sglang_version" in
    0.5.12) default_dest=.gpu-grpo ;;
    0.5.21) default_dest=.gpu-stack-0521 ;;
    *)
        echo "--sglang $sglang_version: this script builds 0.5.12 (the default) or 0.5.21" >&2
        exit 2
        ;;
esac
((nixl)) && default_dest=.gpu-nixl
dest=${1:-$default_dest}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"
if git rev-parse --git-dir >/dev/null 2>&1; then
    rel="${dest#"$root"/}"
    ex="$(git rev-parse --git-common-dir)/info/exclude"
    mkdir -p "$(dirname "$ex")"
    [[ "$rel" == /* ]] || grep -qx "/$rel/" "$ex" 2>/dev/null || echo "/$rel/" >>"$ex"
fi

plat=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
    manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    plat+=(--platform "$p")
done

# SGLang 0.5.12 server (verl 0.9.1's pin) with triton attention; the transformers/tokenizers every side imports.
sglang=(sglang==0.5.12 sglang-kernel==0.4.2.post2 flashinfer-python==0.6.11.post1 xgrammar==0.2.0
    transformers==5.10.4 tokenizers==0.22.2 apache-tvm-ffi==0.1.9
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 typing-inspection==0.4.5
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 opentelemetry-api==1.45.2
    orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7
    gguf==0.19.0 compressed-tensors==0.20.1 pyzmq==27.3.0 ipython==9.18.1 traitlets==5.16.1
    openai==2.6.1 jiter==0.14.0 distro==1.9.0 sniffio==1.3.1 soundfile==0.13.1 cffi==2.1.1 pycparser==2.23
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
    loguru==0.7.3 dill==0.4.1 mooncake-transfer-engine-cuda13==0.3.14)
# verl 0.9.1 and what its trainer, workers and RL dataset import (ray's own needs are on the device).
verl=(verl==0.9.1 ray==2.60.0 hydra-core==1.3.8 omegaconf==2.3.1 tensordict==0.10.0 pyvers==0.1.0
    importlib-metadata==10.2.0 torchdata==0.11.0 codetiming==1.4.0 datasets==5.2.0 multiprocess==0.70.19
    pylatexenc==2.11 cachetools==8.0.2)
# Megatron trainer: megatron-core and Megatron-Bridge (its declared deps are mostly optional extras). verl's HF
# checkpoint (AutoBridge.save_hf_weights) imports ModelOpt's is_quantized, and ModelOpt imports pulp (its solver
# binaries are dropped below); ModelOpt's scipy, nvidia-ml-py, ninja, rich are on the device.
megatron=(megatron-core==0.19.2 megatron-bridge==0.6.2 nvidia-modelopt==0.44.0 pulp==3.3.2)
# verl's make_megatron_module imports megatron.bridge.training.config, which imports Megatron-Energon (the bridge's
# multimodal dataloader; the run never loads data through it). The real package and what its import needs; its s3fs /
# aiobotocore needs are imported only when an s3:// path is opened, and stay behind.
energon=(megatron-energon==7.4.1 multi-storage-client==1.3.1 webdataset==1.0.2 braceexpand==0.1.7 filetype==1.2.0
    mfusepy==3.1.1 rapidyaml==0.15.2 deprecation==2.1.0 xattr==1.3.1 jmespath==1.1.0 wcmatch==10.1 bracex==2.6
    lark==1.3.1 prettytable==3.17.0 wcwidth==0.2.14 pyroute2==0.9.7 tzdata==2025.3)

# SGLang 0.5.21 pins torch==2.13.0. Against the device's torch 2.11.0+cu130 set, torch 2.13.0's METADATA changes
# cuda-toolkit 13.0.2 -> 13.0.3 (of its parts only cuBLAS, 13.1.0.3 -> 13.1.1.3), cuDNN 9.19.0.56 -> 9.20.0.48,
# cuSPARSELt 0.8.0 -> 0.8.1, NCCL 2.28.9 -> 2.29.7 and triton 3.6.0 -> 3.7.1. Travelling: NCCL (torch 2.13's libraries
# call ncclCommSuspend, ncclSignal, ... which 2.28.9 lacks), cuDNN (torch refuses a runtime cuDNN older than the one
# it was built with, and torch._C._cudnn.getCompileVersion() is 9.20.0) and triton (pinned exactly). Staying behind:
# cuBLAS and cuSPARSELt, whose device builds export every symbol torch 2.13's libraries import (nm -D) and which
# torch does not version-check. torchvision 0.28.0 travels because transformers imports torchvision when it is
# installed, and the device's 0.26 is built for torch 2.11.
torch_0521=(torch==2.13.0 triton==3.7.1 nvidia-cudnn-cu13==9.20.0.48 nvidia-nccl-cu13==2.29.7 torchvision==0.28.0)
# The server and its pins; the rest of its needs are those of 0.5.12 above (same names, same versions).
# sgl-deep-gemm: without it SGLang's deepseek_v2 / glm4_moe / kimi model modules fail to import and the server
# silently serves those architectures through its generic Transformers backend instead.
sglang_0521=(sglang==0.5.21 sglang-kernel==0.4.7 flashinfer-python==0.6.18 xgrammar==0.2.7 transformers==5.12.1
    tokenizers==0.22.2 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 sgl-deep-gemm==0.2.0)

# Members left out of a wheel (zip -d, no recompression): never loaded on the device's run. sglang-kernel: the triton
# attention path never loads FlashAttention-3 (flash_ops, 1 GiB unpacked), FlashMLA, InfLLM (built for CPython 3.10)
# or the sm100 build (the H200 is sm90; gpu_stack_install.sh links sm100 -> sm90 for processes that see no GPU).
# Ray, Mooncake, pulp, Megatron-Bridge's recipes: as for 0.5.12 (what the run never imports).
strip_0521() {
    case "$1" in
        sglang_kernel-*) echo 'sgl_kernel/flash_ops.abi3.so sgl_kernel/flashmla_ops.abi3.so' \
            'sgl_kernel/infllm_ops.cpython-310-*.so sgl_kernel/sm100/*' ;;
        ray-*) echo 'ray/jars/* ray/dashboard/client/* ray/tests/* ray/air/tests/* ray/serve/* ray/rllib/*' \
            'ray/tune/* ray/train/* ray/data/* ray/llm/*' ;;
        mooncake_transfer_engine_cuda13-*) echo 'mooncake/mooncake_client mooncake/mooncake_master' \
            'mooncake/transfer_engine_bench mooncake/_store.cpython-*.so mooncake/_ep.cpython-*.so' \
            'mooncake/libmooncake_pg*.so mooncake/libmooncake_ep_device.so' ;;
        pulp-*) echo 'pulp/solverdir/* pulp/tests/*' ;;
        # triton: the sm100+ assembler, static archives, the instrumentation test library
        triton-*) echo 'triton/backends/nvidia/bin/ptxas-blackwell triton/backends/nvidia/lib/cupti/*.a' \
            'triton/instrumentation/libGPUInstrumentationTestLib.so' ;;
        megatron_bridge-*) echo 'megatron/bridge/recipes/*' ;;
    esac
}

# Drop members matching the patterns from a copy of a wheel and from its RECORD (pip installs what the zip holds).
strip_wheel() {
    local whl=$1
    shift
    set -f
    local pats=($*)
    set +f
    zip -q -d "$whl" "${pats[@]}" >/dev/null || { [[ $? == 12 ]] || return 1; }  # 12: nothing matched
    "$python" - "$whl" <<'PY'
import sys, zipfile
whl = sys.argv[1]
with zipfile.ZipFile(whl) as z:
    names = set(z.namelist())
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    rows = z.read(record).decode().splitlines()
kept = [r for r in rows if r.split(",")[0] in names or r.split(",")[0] == record]
with open(whl + ".RECORD", "w") as f:
    f.write("\n".join(kept) + "\n")
print(record)
PY
}

build_0521() {
    local spec name keep s
    local sglang_all=("${sglang_0521[@]}")
    for spec in "${sglang[@]}"; do
        name=${spec%%==*} keep=1
        for s in "${sglang_0521[@]}"; do [[ "${s%%==*}" == "$name" ]] && keep=0; done
        if ((keep)); then sglang_all+=("$spec"); fi
    done
    local all=("${torch_0521[@]}" "${sglang_all[@]}" "${verl[@]}" "${megatron[@]}" "${energon[@]}")
    local wheels="$dest/wheels" carry="$dest/carry"
    local stamp
    stamp="$(printf '%s\n' "${all[@]}" | sha256sum | cut -c1-16)"
    [[ "$(cat "$dest/.stamp" 2>/dev/null)" == "$stamp" ]] || rm -rf "$wheels"  # a changed list starts afresh
    rm -rf "$carry" "$dest"/part.* "$dest/parts.sha256"
    mkdir -p "$wheels" "$carry"
    local t0=$SECONDS
    # pip skips a wheel already in $wheels: a second run downloads nothing
    # NCCL's wheel is tagged manylinux_2_18 only (not in the 0.5.12 list, which stays as it is)
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
        --platform manylinux_2_18_x86_64 -d "$wheels" "${all[@]}"
    compgen -G "$wheels/antlr4_python3_runtime-4.9.3-*.whl" >/dev/null ||
        "$python" -m pip wheel -q --no-deps -w "$wheels" antlr4-python3-runtime==4.9.3
    echo "$stamp" >"$dest/.stamp"
    echo "downloaded in $((SECONDS - t0)) s: $(ls "$wheels" | wc -l) wheels, $(du -sm "$wheels" | cut -f1) MiB"

    local whl base pats record
    for whl in "$wheels"/*.whl; do
        base=$(basename "$whl")
        pats=$(strip_0521 "$base")
        if [[ -z "$pats" ]]; then
            ln "$whl" "$carry/$base" 2>/dev/null || cp "$whl" "$carry/$base"
            continue
        fi
        cp "$whl" "$carry/$base"
        # shellcheck disable=SC2086
        record=$(strip_wheel "$carry/$base" $pats)
        mkdir -p "$carry/.rec/$(dirname "$record")"
        mv "$carry/$base.RECORD" "$carry/.rec/$record"
        (cd "$carry/.rec" && zip -q "../$base" "$record")
        rm -rf "$carry/.rec"
        echo "stripped $base: $(($(stat -c %s "$whl") >> 20)) -> $(($(stat -c %s "$carry/$base") >> 20)) MiB"
    done
    # Largest first: the big wheels fill whole parts; the split is of a plain tar (the wheels are zips already).
    (cd "$carry" && ls -S -- *.whl >"$dest/wheels.txt")
    tar -C "$carry" -cf - -T "$dest/wheels.txt" | split -b "${PART_MIB}M" - "$dest/part."
    (cd "$dest" && sha256sum part.* >parts.sha256)
    rm -rf "$carry"
    ls -la "$dest"/part.*
    echo "$(ls "$dest"/part.* | wc -l) part(s), $(du -cm "$dest"/part.* | tail -1 | cut -f1) MiB in $dest, built in" \
        "$((SECONDS - t0)) s: carry one per device call (with parts.sha256), the last with the run (recipes/README.md)"
}

# NIXL for verl's own nixl checkpoint engine (BACKEND=nixl): the CUDA 13 build (UCX and its plugins bundled) and the
# `nixl` shim that maps nixl._api / nixl._bindings onto it. Installed as the device will see it, under site/ (it
# unpacks beside the main stack); its headers and example scripts stay behind. One part of about 50 MiB.
if ((nixl)); then
    rm -rf "$dest/site" "$dest"/part.*
    mkdir -p "$dest/wheels"
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
        -d "$dest/wheels" nixl==1.5.1 nixl-cu13==1.5.1
    "$python" -m pip install -q --no-deps --no-compile --no-warn-script-location --target "$dest/site" \
        "$dest"/wheels/*.whl
    rm -rf "$dest/site/bin" "$dest/site/include" "$dest/site/share"
    find "$dest/site" -name __pycache__ -type d -prune -exec rm -rf {} +
    tar -C "$dest" -cf - site | xz -T0 -6 | split -b "${PART_MIB}M" - "$dest/part."
    ls -la "$dest"/part.*
    exit 0
fi

# The SGLang 0.5.21 stack (weight-update sessions): torch 2.13 and its changed CUDA libraries travel too, as the
# wheels themselves (already compressed: no xz), tar'd and split; scripts/gpu_stack_install.sh installs them there.
if [[ "$sglang_version" == 0.5.21 ]]; then
    build_0521
    exit 0
fi

wheels="$dest/wheels"
stamp="$(printf '%s\n' "${sglang[@]}" "${verl[@]}" "${megatron[@]}" "${energon[@]}" | sha256sum | cut -c1-16)"
[[ "$(cat "$dest/.stamp" 2>/dev/null)" == "$stamp" ]] || rm -rf "$wheels"  # a changed list starts afresh
rm -rf "$dest/site" "$dest"/part.*
mkdir -p "$wheels"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$wheels" "${sglang[@]}" "${verl[@]}" "${megatron[@]}" "${energon[@]}"
# hydra's parser runtime is an sdist only: build its (pure-Python) wheel here.
"$python" -m pip wheel -q --no-deps -w "$wheels" antlr4-python3-runtime==4.9.3
echo "$stamp" >"$dest/.stamp"

# Install into one tree as the device will see it (no byte-code: the device's 3.12.3 writes its own).
"$python" -m pip install -q --no-deps --no-compile --no-warn-script-location --target "$dest/site" "$wheels"/*.whl

# Never loaded on the device's run: keep the parts few.
site="$dest/site"
# Ray: the Java jars, the dashboard's web client, the libraries (serve, tune, train, data, rllib, llm).
rm -rf "$site"/bin "$site"/ray/jars "$site"/ray/dashboard/client "$site"/ray/tests "$site"/ray/air/tests \
    "$site"/ray/serve "$site"/ray/rllib "$site"/ray/tune "$site"/ray/train "$site"/ray/data "$site"/ray/llm \
    "$site"/megatron/bridge/recipes
# The triton attention path never loads FlashAttention-3, FlashMLA or sm100 kernels (307 MiB wheel); mscclpp is
# built for CPython 3.10 (never importable here) and serves TP>1 all-reduce only.
rm -f "$site"/sgl_kernel/flash_ops.abi3.so "$site"/sgl_kernel/flashmla_ops.abi3.so "$site"/_mscclpp.cpython-310-*.so
rm -rf "$site"/sgl_kernel/sm100 "$site"/lib
# A process that sees no GPU (verl's rollout-side CheckpointEngineWorker imports sgl_kernel) looks for its ops under
# sm100/: point that at the sm90 build, which loads on any x86-64 host (no sm100 GPU runs here).
ln -s sm90 "$site"/sgl_kernel/sm100
# Mooncake: only mooncake.engine (TransferEngine: engine.so + libasio + libetcd_wrapper) is used; not the store,
# its master/client binaries, the torch process-group backend or expert parallelism.
rm -f "$site"/mooncake/mooncake_client "$site"/mooncake/mooncake_master "$site"/mooncake/transfer_engine_bench \
    "$site"/mooncake/_store.cpython-*.so "$site"/mooncake/_ep.cpython-*.so "$site"/mooncake/libmooncake_pg*.so \
    "$site"/mooncake/libmooncake_ep_device.so
rm -f "$site"/xgrammar/lib/*.a  # static archive, never loaded
rm -rf "$site"/pulp/solverdir "$site"/pulp/tests  # LP solver binaries: ModelOpt only imports pulp
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$site" -path '*/tests/*' -name 'test_*.py' -delete

du -sh "$site"
tar -C "$dest" -cf - site | xz -T0 -6 | split -b "${PART_MIB}M" - "$dest/part."
ls -la "$dest"/part.*
echo "$(ls "$dest"/part.* | wc -l) part(s) of at most $PART_MIB MiB in $dest: one device call per part (see recipes/README.md)"

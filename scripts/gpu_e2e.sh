#!/usr/bin/env bash
# On the H200 machine: unpack the carried stack once (scripts/gpu_wheels.sh builds it; its parts are copied to
# $STACK by earlier calls), then prove p2p syncs into real SGLang GPU servers: `verl-p2p e2e --rollout sglang`.
# The JSON report, the run's log and the servers' logs go to $OUT. Extra arguments go to `verl-p2p e2e`.
# SGLANG_STACK=0.5.21: the SGLang 0.5.21 / torch 2.13 stack instead (`scripts/gpu_wheels.sh --sglang 0.5.21`), installed
# into $SITE21 (default /tmp/site21) by scripts/gpu_stack_install.sh from the parts in /tmp/stack21.
set -uo pipefail
source "$(dirname "$0")/private_dir.sh"
# STACK and SITE last across device calls (earlier calls carry the parts; a warm machine keeps the unpacked stack),
# so their names are fixed and checked private (scripts/private_dir.sh); the e2e's workdir lives for this call only
STACK=${STACK:-/tmp/stack}
SITE_ROOT=${SITE_ROOT:-/tmp}  # scripts/gpu_wheels.sh's parts unpack to $SITE_ROOT/site
SITE="$SITE_ROOT/site"
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
if [ "${SGLANG_STACK:-0.5.12}" = 0.5.21 ]; then
  SITE=${SITE21:-/tmp/site21}
  SITE21="$SITE" bash "$(dirname "$0")/gpu_stack_install.sh" 2>&1 | tee "$OUT/install.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || exit 3
elif [ "${SGLANG_STACK:-0.5.12}" != 0.5.12 ]; then
  echo "SGLANG_STACK=$SGLANG_STACK: expected 0.5.12 (the default) or 0.5.21" >&2
  exit 2
elif ! private_dir "$STACK" STACK || ! private_dir "$SITE" SITE_ROOT; then
  exit 3
elif [ ! -d "$SITE/verl" ]; then
  cat "$STACK"/part.* | python3 -c 'import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1], filter="tar")' "$SITE_ROOT" || exit 3
fi
export PYTHONPATH="$SITE:$PWD" CUDA_HOME=/usr/local/cuda MC_LOG_LEVEL=ERROR PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/imports.txt"
import importlib, time
for name in ("torch", "sglang", "sgl_kernel", "mooncake.engine", "megatron.core", "megatron.bridge", "ray", "verl",
             "verl.workers.engine.megatron.transformer_impl", "verl_p2p.trainer.source", "verl_p2p.replica"):
    t0 = time.perf_counter()
    try:
        mod = importlib.import_module(name)
        print(f"ok   {name} {getattr(mod, '__version__', '')} ({time.perf_counter() - t0:.1f}s)")
    except Exception as exc:
        print(f"FAIL {name}: {type(exc).__name__}: {exc}")
PY
WORK=$(mktemp -d)
python3 -m verl_p2p.cli e2e --rollout sglang --workdir "$WORK" --out "$OUT/e2e_h200.json" "$@" 2>&1 | tee "$OUT/e2e.log"
status=${PIPESTATUS[0]}
tar czf "$OUT/server_logs.tgz" "$WORK"/*/*.log 2>/dev/null
rm -rf "$WORK"
exit "$status"

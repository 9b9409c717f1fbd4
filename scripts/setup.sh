#!/usr/bin/env bash
# Idempotent set-up: Debian libs, a Python 3.12 venv at .venv with the project's stack, and the extra SGLang
# releases of the replica matrix in .venv/sglang-<version> (each put first on sys.path by the replica tests).
#
# Installer: uv (installed into the venv with pip; resolves and installs the same pinned stack several times
# faster than pip; README has the measured times). VERL_P2P_INSTALLER=pip uses pip for everything.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# SGLang releases installed beside the venv's own (0.5.12): the replica-exact matrix runs on each.
EXTRA_SGLANG=(0.5.21 0.5.23)

find_python312() {
  for c in python3.12 "$(command -v pyenv >/dev/null 2>&1 && echo "$(pyenv root)/versions/"3.12*/bin/python3.12)"; do
    for p in $c; do
      if [ -x "$(command -v "$p" 2>/dev/null || echo "$p")" ] && "$p" -c 'import sys; assert sys.version_info[:2]==(3,12)' 2>/dev/null; then
        echo "$p"; return 0
      fi
    done
  done
  for p in /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -x "$p" ] && { echo "$p"; return 0; }
  done
  return 1
}

if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
fi

py="$(find_python312)" || { echo "setup: Python 3.12 not found (install it, e.g. pyenv install 3.12)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$py" -m venv .venv
installer="${VERL_P2P_INSTALLER:-uv}"
if [ "$installer" = uv ]; then
  [ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q uv==0.13.9
  # --compile-bytecode: pip writes .pyc files at install and uv does not; where PYTHONDONTWRITEBYTECODE is set (this
  # CI's machines) every test process would compile torch, SGLang and Megatron from source again (measured: the
  # suite's CPU time doubled, 28 vs 13 min)
  install=(.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python)
else
  install=(.venv/bin/python -m pip install -q)
fi
pinned=("${install[@]}" -c constraints.txt)
stamp=.venv/.verl-p2p-setup
want="$(cat constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  [ "$installer" = uv ] || .venv/bin/python -m pip install -q --upgrade pip
  "${pinned[@]}" torch==2.11.0 torchvision==0.26.0
  "${pinned[@]}" verl==0.9.1 uvicorn fastapi transformers==5.10.4 megatron-core==0.19.2 einops \
    mooncake-transfer-engine-non-cuda==0.3.13.post1 \
    pybase64 msgspec pyzmq IPython sentencepiece compressed-tensors gguf openai partial-json-parser orjson \
    pytest pytest-timeout pytest-xdist==3.8.0 ruff requests aiohttp matplotlib==3.11.2 cachetools==8.0.2
  "${pinned[@]}" --no-deps megatron-bridge==0.6.2 sglang==0.5.12
  for v in "${EXTRA_SGLANG[@]}"; do
    if [ ! -d ".venv/sglang-$v/sglang-$v.dist-info" ]; then
      rm -rf ".venv/sglang-$v"
      "${install[@]}" --no-deps --target ".venv/sglang-$v" "sglang==$v" apache-tvm-ffi==0.1.15.post2
    fi
  done
  echo "$want" > "$stamp"
fi
# The project itself, editable, every time (cheap): picks up entry-point changes.
"${install[@]}" --no-deps -e . >/dev/null 2>&1 || .venv/bin/python -m pip install -q --no-deps -e .
echo "setup: .venv ready ($(.venv/bin/python --version), installer $installer)"

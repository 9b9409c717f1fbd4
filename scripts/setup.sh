#!/usr/bin/env bash
# Idempotent set-up: Debian libs, a Python 3.12 venv at .venv with the project's stack, the
# second SGLang version in .venv/sglang-0.5.23 (put first on sys.path by the replica tests).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

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
pip=(.venv/bin/python -m pip install -q -c constraints.txt)
stamp=.venv/.verl-p2p-setup
want="$(cat constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  "${pip[@]}" torch==2.11.0 torchvision==0.26.0
  "${pip[@]}" verl==0.9.1 uvicorn fastapi transformers==5.10.4 megatron-core==0.19.2 einops \
    mooncake-transfer-engine-non-cuda==0.3.13.post1 \
    pybase64 msgspec pyzmq IPython sentencepiece compressed-tensors gguf openai partial-json-parser orjson \
    pytest pytest-timeout ruff requests aiohttp
  "${pip[@]}" --no-deps megatron-bridge==0.6.2 sglang==0.5.12
  if [ ! -d .venv/sglang-0.5.23/sglang-0.5.23.dist-info ]; then
    rm -rf .venv/sglang-0.5.23
    .venv/bin/python -m pip install -q --no-deps --target .venv/sglang-0.5.23 sglang==0.5.23 apache-tvm-ffi
  fi
  echo "$want" > "$stamp"
fi
# The project itself, editable, every time (cheap): picks up entry-point changes.
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
  || .venv/bin/python -m pip install -q --no-deps -e .
echo "setup: .venv ready ($(.venv/bin/python --version))"

"""CPU-host shims for building SGLang model classes where no GPU kernels exist (tests, demo, loopback).

SGLang's rotary embedding imports `vllm._custom_ops.rotary_embedding` on a host that is neither CUDA nor
SGLang-CPU. The p2p paths never run a forward pass, so a stand-in module whose kernel refuses to run is
enough. Installed only when no accelerator is present and no real vllm is importable: never on a GPU host.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def _rotary_embedding_stand_in(*args, **kwargs):
    raise RuntimeError("vllm._custom_ops stand-in (verl_p2p.sandbox.cpu_stubs): no forward pass on a CPU-only host")


def install_cpu_stubs() -> bool:
    """Install the `vllm._custom_ops` stand-in if needed; returns True when it was installed."""
    if "vllm._custom_ops" in sys.modules:
        return False
    import torch

    if torch.cuda.is_available() or importlib.util.find_spec("vllm") is not None:
        return False
    vllm = types.ModuleType("vllm")
    vllm.__verl_p2p_stand_in__ = True
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = _rotary_embedding_stand_in
    vllm._custom_ops = ops
    sys.modules["vllm"] = vllm
    sys.modules["vllm._custom_ops"] = ops
    return True

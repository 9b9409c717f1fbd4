"""Where a trainer source's two transfer slots live: GPU memory, pinned host memory, or plain host memory.

With the HF tensors on a GPU and a CUDA build of Mooncake, slots in GPU memory let the compiled executor
write a rank's bytes at device copy speed and the transport send them straight from GPU memory (GPUDirect
RDMA on real NICs). Otherwise the slots are host memory, pinned on a CUDA host (GPU -> pinned copies run
at PCIe speed; pageable ones at a quarter of it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verl_p2p.errors import P2PConfigError

STAGING_MODES = ("auto", "gpu", "pinned")

_CUDA_MOONCAKE = (
    "install a CUDA build of Mooncake (`pip install mooncake-transfer-engine`, or mooncake-transfer-engine-cuda13 "
    "for CUDA 13) in place of mooncake-transfer-engine-non-cuda, or set engine_kwargs.p2p.staging=pinned"
)


# Seen on an H200 (Mooncake's CUDA 13 build, docs/measurements/mooncake_tcp_h200.json): tcp writes from GPU memory
# into host memory arrived corrupted, and into GPU memory ran slower than from pinned slots.
GPU_OVER_TCP = (
    "Mooncake's tcp transport stages GPU memory through the host itself; GPU -> host-memory writes arrived "
    "corrupted on an H200 and GPU -> GPU ones were slower than from pinned slots. Fix: staging=pinned (or auto) "
    "over tcp, or protocol=rdma for GPU slots"
)


@dataclass(frozen=True)
class StagingChoice:
    """The slots' device and pinning, and why (logged once when the buffers are made)."""

    device: torch.device
    pin_memory: bool
    reason: str

    @property
    def kind(self) -> str:
        if self.device.type == "cuda":
            return "gpu"
        return "pinned" if self.pin_memory else "host"


def choose_staging(
    mode: str,
    hf_device: torch.device | str,
    gpu_memory_support: Callable[[], tuple[bool, str]] | None = None,
    cuda_available: bool | None = None,
    protocol: str = "rdma",
) -> StagingChoice:
    """Resolve `staging` (auto | gpu | pinned) for HF tensors on `hf_device`.

    `gpu` over `tcp` is refused (GPU_OVER_TCP). `gpu_memory_support()` answers whether the transport can
    register GPU memory (default: the installed Mooncake, `mooncake_gpu_memory_support`); it is asked only when
    a GPU slot is possible. `auto` takes GPU
    slots only over RDMA: Mooncake's tcp transport stages GPU memory through the host itself, so a GPU slot is
    slower there (docs/measurements/mooncake_tcp_h200.json).
    """
    if mode not in STAGING_MODES:
        raise P2PConfigError(f"engine_kwargs.p2p.staging={mode!r}: choose one of {list(STAGING_MODES)}")
    hf_device = torch.device(hf_device)
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if hf_device.type != "cuda":
        if mode == "gpu":
            raise P2PConfigError(
                f"engine_kwargs.p2p.staging=gpu, but the trainer's HF tensors are on {hf_device}, not a GPU: "
                "set staging=auto or pinned"
            )
        if cuda:
            return StagingChoice(torch.device("cpu"), True, f"HF tensors on {hf_device}: pinned host slots")
        return StagingChoice(torch.device("cpu"), False, "no CUDA on this host: plain host slots")
    if mode == "gpu" and protocol == "tcp":
        raise P2PConfigError(f"engine_kwargs.p2p.staging=gpu with protocol=tcp: {GPU_OVER_TCP}")
    if mode == "pinned":
        return StagingChoice(torch.device("cpu"), True, "staging=pinned: pinned host slots")
    if mode == "auto" and protocol == "tcp":
        return StagingChoice(torch.device("cpu"), True, "protocol tcp: pinned host slots (faster than GPU slots there)")
    if gpu_memory_support is None:
        from verl_p2p.transfer.mooncake import mooncake_gpu_memory_support as gpu_memory_support
    ok, why = gpu_memory_support()
    if ok:
        return StagingChoice(hf_device, False, f"GPU slots on {hf_device} ({why})")
    if mode == "gpu":
        raise P2PConfigError(f"engine_kwargs.p2p.staging=gpu, but {why}: {_CUDA_MOONCAKE}")
    return StagingChoice(torch.device("cpu"), True, f"pinned host slots: {why}")


__all__ = ["STAGING_MODES", "StagingChoice", "choose_staging"]

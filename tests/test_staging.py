"""Where the transfer slots live (`staging: auto | gpu | pinned`) and how the installed Mooncake's GPU
support is detected."""

from __future__ import annotations

import pytest
import torch

from verl_p2p.errors import P2PConfigError
from verl_p2p.transfer.mooncake import mooncake_gpu_memory_support
from verl_p2p.transfer.staging import choose_staging

CUDA_BUILD = lambda: (True, "mooncake-transfer-engine 0.3.7 is a CUDA build of Mooncake")  # noqa: E731
HOST_BUILD = lambda: (False, "mooncake-transfer-engine-non-cuda 0.3.13 is Mooncake's build without CUDA")  # noqa: E731


def test_auto_takes_gpu_slots_only_with_cuda_tensors_and_a_cuda_mooncake():
    gpu = choose_staging("auto", "cuda:1", CUDA_BUILD, cuda_available=True)
    assert (gpu.kind, gpu.device) == ("gpu", torch.device("cuda:1")) and "CUDA build" in gpu.reason
    pinned = choose_staging("auto", "cuda:0", HOST_BUILD, cuda_available=True)
    assert pinned.kind == "pinned" and "without CUDA" in pinned.reason
    assert choose_staging("pinned", "cuda:0", CUDA_BUILD, cuda_available=True).kind == "pinned"
    assert choose_staging("auto", "cpu", CUDA_BUILD, cuda_available=True).kind == "pinned"
    assert choose_staging("auto", "cpu", CUDA_BUILD, cuda_available=False).kind == "host"
    assert choose_staging("pinned", "cpu", CUDA_BUILD, cuda_available=False).kind == "host"


def test_auto_keeps_host_slots_over_tcp():
    # Mooncake's tcp transport copies GPU memory through the host itself: pinned slots are faster there
    assert choose_staging("auto", "cuda:0", CUDA_BUILD, cuda_available=True, protocol="tcp").kind == "pinned"
    assert choose_staging("gpu", "cuda:0", CUDA_BUILD, cuda_available=True, protocol="tcp").kind == "gpu"
    assert choose_staging("auto", "cuda:0", CUDA_BUILD, cuda_available=True, protocol="rdma").kind == "gpu"


def test_gpu_staging_refuses_what_cannot_work():
    with pytest.raises(P2PConfigError, match="staging=gpu.*without CUDA.*mooncake-transfer-engine"):
        choose_staging("gpu", "cuda:0", HOST_BUILD, cuda_available=True)
    with pytest.raises(P2PConfigError, match="staging=gpu.*on cpu, not a GPU"):
        choose_staging("gpu", "cpu", CUDA_BUILD, cuda_available=False)
    with pytest.raises(P2PConfigError, match="choose one of"):
        choose_staging("hbm", "cpu")


def test_installed_mooncake_is_detected():
    """This CPU host has mooncake-transfer-engine-non-cuda: no GPU memory, and auto stays on the host."""
    ok, why = mooncake_gpu_memory_support()
    assert not ok and "mooncake-transfer-engine-non-cuda" in why
    choice = choose_staging("auto", "cpu")
    assert choice.kind == ("pinned" if torch.cuda.is_available() else "host")

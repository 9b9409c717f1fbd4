"""Where the transfer slots live (`staging: auto | gpu | pinned`) and how the installed Mooncake's GPU
support is detected."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PConfigError
from verl_p2p.transfer.mooncake import MOONCAKE_CUDA_DISTS, MOONCAKE_HOST_DISTS, mooncake_gpu_memory_support
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


def test_auto_keeps_host_slots_over_tcp_and_gpu_slots_over_tcp_are_refused():
    # Mooncake's tcp transport copies GPU memory through the host itself: pinned slots are faster there, and
    # GPU -> host-memory tcp writes arrived corrupted on an H200, so an explicit `gpu` over tcp is refused
    assert choose_staging("auto", "cuda:0", CUDA_BUILD, cuda_available=True, protocol="tcp").kind == "pinned"
    assert choose_staging("auto", "cuda:0", CUDA_BUILD, cuda_available=True, protocol="rdma").kind == "gpu"
    assert choose_staging("gpu", "cuda:0", CUDA_BUILD, cuda_available=True, protocol="rdma").kind == "gpu"
    with pytest.raises(P2PConfigError, match="staging=gpu with protocol=tcp.*arrived corrupted.*staging=pinned"):
        choose_staging("gpu", "cuda:0", CUDA_BUILD, cuda_available=True, protocol="tcp")
    with pytest.raises(P2PConfigError, match="staging='gpu' with protocol='tcp'.*arrived corrupted"):
        P2PConfig.from_mapping({"staging": "gpu", "protocol": "tcp"})  # refused with the options, before a source
    P2PConfig.from_mapping({"staging": "gpu", "protocol": "rdma"})
    P2PConfig.from_mapping({"staging": "pinned", "protocol": "tcp"})


def test_gpu_staging_refuses_what_cannot_work():
    with pytest.raises(P2PConfigError, match="staging=gpu.*without CUDA.*mooncake-transfer-engine"):
        choose_staging("gpu", "cuda:0", HOST_BUILD, cuda_available=True)
    with pytest.raises(P2PConfigError, match="staging=gpu.*on cpu, not a GPU"):
        choose_staging("gpu", "cpu", CUDA_BUILD, cuda_available=False)
    with pytest.raises(P2PConfigError, match="choose one of"):
        choose_staging("hbm", "cpu")


def _installed_build() -> str | None:
    for dist in MOONCAKE_HOST_DISTS + MOONCAKE_CUDA_DISTS:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return dist
    return None


def test_installed_mooncake_is_detected():
    """Whichever Mooncake wheel this host has: its name decides, and auto stays on the host without CUDA tensors."""
    dist = _installed_build()
    ok, why = mooncake_gpu_memory_support()
    assert dist is not None and dist in why  # the CI hosts install a wheel (non-cuda on CPU, a CUDA build on GPU)
    assert ok == (dist in MOONCAKE_CUDA_DISTS)
    choice = choose_staging("auto", "cpu")
    assert choice.kind == ("pinned" if torch.cuda.is_available() else "host")


@pytest.mark.parametrize(
    "dist, gpu",
    [
        ("mooncake-transfer-engine-non-cuda", False),
        ("mooncake-transfer-engine", True),
        ("mooncake-transfer-engine-cuda13", True),
    ],
)
def test_each_mooncake_wheel_is_classified_by_its_name(monkeypatch, dist, gpu):
    def version(name: str) -> str:
        if name != dist:
            raise importlib.metadata.PackageNotFoundError(name)
        return "0.3.14"

    monkeypatch.setattr(importlib.metadata, "version", version)
    ok, why = mooncake_gpu_memory_support()
    assert ok is gpu and why.startswith(f"{dist} 0.3.14 is ")

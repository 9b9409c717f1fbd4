"""The rollout platforms whose post-load weight processing leaves the published bytes as SGLang's loader wrote
them: an allow-list, refusing the rest by name.

After loading (and again at every weight-update session end) SGLang runs each layer's quant method
`process_weights_after_loading`. For unquantized weights that is a no-op on NVIDIA CUDA and on ROCm without
AITER, but it rewrites weights elsewhere: with `SGLANG_USE_AITER` on ROCm the MoE method shuffles w13/w2 into
16x16 tiles, and SGLang's CPU engine AMX-packs linear and MoE weights on hosts with AMX. None of that shows in
`/server_info`, so the platform is checked where the server runs (`check_platform`, at launch) and the device
it reports at connect (`device_problem`). Quantized rollouts are refused elsewhere (replica/rank_context.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl_p2p.errors import P2PConfigError, UnsupportedLayoutError

# (platform, why its unquantized post-load processing leaves the loader's bytes alone)
ALLOWED = {
    "cuda": "UnquantizedLinearMethod / UnquantizedFusedMoEMethod post-processing is a no-op on NVIDIA CUDA",
    "rocm": "the same methods are a no-op on ROCm while SGLANG_USE_AITER is off",
    "cpu": "the CPU engine leaves weights as loaded on a host without AMX",
}
CONNECT_DEVICES = ("cuda",)  # what /server_info may report: the CPU engine's AMX packing is invisible there


@dataclass(frozen=True)
class Platform:
    """Where a rollout server runs, as far as SGLang's post-load processing depends on it."""

    device: str  # SGLang's device: "cuda", "cpu", "npu", "xpu", ...
    hip: bool = False  # torch built for ROCm (SGLang's device is still "cuda")
    aiter: bool = False  # SGLANG_USE_AITER on
    cpu_amx: bool = False  # the host's CPU has AMX tiles (SGLang's CPU engine packs weights for them)

    @property
    def name(self) -> str:
        if self.device == "cuda":
            return "rocm" if self.hip else "cuda"
        return self.device


def local_platform(device: str | None = None) -> Platform:
    """This process's platform (call it where the rollout server runs); `device` as the server args set it."""
    import torch

    hip = bool(getattr(torch.version, "hip", None))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    amx = False
    probe = getattr(getattr(torch._C, "_cpu", None), "_is_amx_tile_supported", None)
    if device == "cpu" and probe is not None:
        amx = bool(probe())
    aiter = os.environ.get("SGLANG_USE_AITER", "").strip().lower() in ("1", "true", "yes", "on")
    return Platform(device=device, hip=hip, aiter=aiter, cpu_amx=amx)


def platform_problem(platform: Platform) -> str | None:
    """Why SGLang's post-load processing on `platform` would rewrite published weights, or None when it is on
    the allow-list."""
    name = platform.name
    if name not in ALLOWED:
        return (
            f"device {platform.device!r}: its post-load weight processing is not on p2p's allow-list of "
            f"platforms known to keep the loader's bytes ({', '.join(ALLOWED)}); run the rollout on CUDA"
        )
    if name == "rocm" and platform.aiter:
        return (
            "ROCm with SGLANG_USE_AITER on: UnquantizedFusedMoEMethod.process_weights_after_loading shuffles the "
            "MoE w13/w2 weights into 16x16 tiles after loading, so p2p's bytes would land unshuffled; "
            "unset SGLANG_USE_AITER for the rollout"
        )
    if name == "cpu" and platform.cpu_amx:
        return (
            "SGLang's CPU engine on a host with AMX: the unquantized linear and MoE methods AMX-pack their weights "
            "after loading, so p2p's bytes would land unpacked; run the rollout on CUDA"
        )
    return None


def check_platform(platform: Platform, where: str) -> None:
    """Raise P2PConfigError naming the platform's post-processing when it is not on the allow-list."""
    problem = platform_problem(platform)
    if problem is not None:
        raise P2PConfigError(f"{where}: {problem}")


def device_problem(server_info: Mapping[str, Any]) -> str | None:
    """At connect: a reported device other than CUDA (the CPU engine's AMX packing, NPU/XPU/... processing
    cannot be seen from /server_info); None when the answer names no device (then launch checked it)."""
    device = server_info.get("device")
    if device is None or str(device) in CONNECT_DEVICES:
        return None
    return (
        f"device={device!r}: whether SGLang's post-load processing rewrites weights there cannot be told from "
        f"/server_info (p2p's allow-list at connect: {', '.join(CONNECT_DEVICES)}); run the rollout on CUDA"
    )


def check_device(server_info: Mapping[str, Any], where: str) -> None:
    problem = device_problem(server_info)
    if problem is not None:
        raise UnsupportedLayoutError(f"{where}: {problem}")

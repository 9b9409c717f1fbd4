"""The SGLang `--mem-fraction-static` the e2e, the real-SGLang soak and cost growth give their real servers.

An explicit `--mem-fraction` always wins. Otherwise the fraction comes from the GPU at hand (its memory, as
`nvidia-smi` reports it) and the models' bytes, through `real_sizes.budget_of`, the one copy of the arithmetic; a
run that fits no fraction is refused here, with its numbers and the ways out, before any checkpoint is written or
server launched. A fixed default fitted one GPU and model and killed both servers on another. The loopback
rollout has no use for a fraction.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from verl_p2p.e2e.real_sizes import GIB, budget_of, usable_gpu_bytes

FIXES = "use fewer --layers, --one-server-at-a-time, --fp8 (a block-FP8 rollout), or pass --mem-fraction explicitly"


class MemFractionError(ValueError):
    """No mem fraction lets this run's servers start on this GPU, or the GPU's memory could not be read."""


@dataclass(frozen=True)
class MemFraction:
    """The fraction the servers get and where it came from (the JSON report records it)."""

    value: float | None  # None: no real SGLang server (the loopback rollout ignores it)
    source: str  # "--mem-fraction", "computed from the GPU", or "unused (loopback rollout)"
    gpu_bytes: int | None = None  # the usable GPU memory the computation planned with
    budget: dict[str, Any] | None = None  # real_sizes.GpuBudget.to_dict() of the computation

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gpu_gib"] = None if self.gpu_bytes is None else round(self.gpu_bytes / GIB, 2)
        return out


GPU_MIB_ENV = "VERL_P2P_GPU_MIB"  # a memory.total (MiB) to plan with instead of asking nvidia-smi


def gpu_bytes_at_hand() -> int:
    """Usable memory of the first GPU this process sees (nvidia-smi's memory.total less the driver's share); read
    without a CUDA context, which would hold GPU memory for the whole run. `VERL_P2P_GPU_MIB` names the
    memory.total instead (planning for another GPU, or a subprocess test on a host without one)."""
    if os.environ.get(GPU_MIB_ENV):
        try:
            return usable_gpu_bytes(int(os.environ[GPU_MIB_ENV]))
        except ValueError as exc:
            raise MemFractionError(f"{GPU_MIB_ENV}={os.environ[GPU_MIB_ENV]!r}: give the MiB as an integer") from exc
    device = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    if shutil.which("nvidia-smi") is None:
        raise MemFractionError("no nvidia-smi to read the GPU's memory from: pass --mem-fraction explicitly")
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", device, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        return usable_gpu_bytes(int(out[0]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise MemFractionError(f"nvidia-smi did not give GPU {device}'s memory ({exc}): pass --mem-fraction") from exc


def mem_fraction_for(
    configs: Sequence[Mapping[str, Any]],
    *,
    rollout: str,
    explicit: float | None,
    quant: str = "bf16",
    one_server: bool = False,
    slot_bytes: int,
    read_gpu_bytes: Callable[[], int] = gpu_bytes_at_hand,
    what: str = "",
) -> MemFraction:
    """The fraction for servers of `configs` (models sharing the GPU, each with its own trainer and servers):
    `explicit` when given, else the smallest `budget_of` admits on the GPU `read_gpu_bytes` reports."""
    if explicit is not None:
        if not 0 < explicit < 1:
            raise MemFractionError(f"--mem-fraction {explicit}: SGLang's mem_fraction_static is between 0 and 1")
        return MemFraction(explicit, "--mem-fraction")
    if rollout != "sglang":
        return MemFraction(None, "unused (loopback rollout)")
    gpu_bytes = read_gpu_bytes()
    budget = budget_of(list(configs), quant, not one_server, gpu_bytes=gpu_bytes, slot_bytes=slot_bytes)
    if not budget.fits:
        raise MemFractionError(
            f"{what or 'this run'} does not fit on this GPU ({gpu_bytes / GIB:.1f} GiB usable): {budget.why}. "
            f"To run it, {FIXES}"
        )
    return MemFraction(budget.mem_fraction, "computed from the GPU", gpu_bytes, budget.to_dict())


def e2e_mem_fraction(args: argparse.Namespace, read_gpu_bytes: Callable[[], int] = gpu_bytes_at_hand) -> MemFraction:
    """`mem_fraction_for` the models, size, depth, rollout quantization and server order of the e2e's `args`."""
    from verl_p2p.e2e.sizes import model_overrides
    from verl_p2p.sandbox.tiny import tiny_config_dict

    configs = [tiny_config_dict(arch, **model_overrides(args.size, arch, args.layers)) for arch in args.models]
    depth = f" at {args.layers} layers" if args.layers is not None else ""
    return mem_fraction_for(
        configs,
        rollout=args.rollout,
        explicit=args.mem_fraction,
        quant="fp8" if args.fp8 else "bf16",
        one_server=args.one_server_at_a_time,
        slot_bytes=2 * (args.bucket_mb << 20),
        read_gpu_bytes=read_gpu_bytes,
        what=f"--models {','.join(args.models)} --size {args.size}{depth}{' --fp8' if args.fp8 else ''}"
        + (" --one-server-at-a-time" if args.one_server_at_a_time else ""),
    )

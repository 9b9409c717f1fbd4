"""GPU host check of the transfer buffers' staging: on a CUDA host the two slots must be pinned, and a device ->
slot copy (what a replica load does with GPU-resident HF tensors) should run at PCIe/NVLink-C2C speed.

    python3 scripts/gpu_staging_bandwidth.py [--slot-mb 512] [--repeat 10]

Uses `TransferBuffers` with a registration-recording transport (a stand-in: the CUDA Mooncake wheel is larger
than a device call can carry); compares against a pageable slot of the same size. Prints GB/s, median of runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
pkg = types.ModuleType("verl_p2p")  # the transfer modules without the package __init__ (which imports verl)
pkg.__path__ = [str(ROOT / "verl_p2p")]
sys.modules.setdefault("verl_p2p", pkg)

import torch  # noqa: E402

from verl_p2p.transfer.buffers import TransferBuffers  # noqa: E402


class RecordingTransport:
    """Stand-in transport: records registrations, moves nothing."""

    session_id = "stand-in:0"

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}

    def register(self, addr: int, nbytes: int) -> None:
        self.registered[addr] = nbytes

    def unregister(self, addr: int) -> None:
        self.registered.pop(addr, None)

    def write(self, *args, **kwargs) -> None:  # pragma: no cover - never called here
        raise RuntimeError("stand-in transport")


def _gbps(dst: torch.Tensor, src: torch.Tensor, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return src.numel() / statistics.median(times) / 1e9


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--slot-mb", type=int, default=512)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--json-out")
    args = p.parse_args()
    nbytes = args.slot_mb << 20
    transport = RecordingTransport()
    buffers = TransferBuffers(nbytes, transport)
    buffers.begin()
    slot, _ = buffers.next_slot()
    view = slot.view(0, nbytes)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    result = {
        "device": torch.cuda.get_device_name(),
        "slot_bytes": nbytes,
        "slots_pinned": bool(buffers.pinned and view.is_pinned()),
        "registered_slots": len(transport.registered),
        "d2h_pinned_slot_gbps": _gbps(view, src, args.repeat),
        "d2h_pageable_gbps": _gbps(pageable, src, args.repeat),
    }
    result["bytes_equal"] = bool(torch.equal(view.cuda(), src))
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    buffers.release()
    return 0 if result["slots_pinned"] and result["bytes_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())

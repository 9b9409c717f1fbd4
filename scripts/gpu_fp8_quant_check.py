"""The block-FP8 quantizer on a GPU, without pytest (the device's stack has none): exact bytes, then throughput.

1. Exactness: tensors of several shapes (ragged edges included), dtypes and magnitudes, quantized on `--device`
   by the torch reference itself on that device, by the one-launch Triton kernel directly
   (`quant/block_fp8_triton.py`, where it applies) and through `quantize_many`, each compared byte for byte with
   the CPU torch reference.
2. Throughput, side by side in one run: a MoE layer's experts (`--experts` x 768 x 2048 bf16) through the fused
   kernel and through the eager torch reference on the same device, in G elements/s and GB/s of FP8 bytes.
JSON to `--out`; exit 1 when any byte differs. `--device cpu` (CI) runs the eager path only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from verl_p2p.quant import block_fp8, block_fp8_triton
from verl_p2p.quant.block_fp8 import BLOCK, quantize_block_fp8, quantize_many

SHAPES = [(2048, 768), (768, 2048), (200, 300), (129, 4097), (1, 1), (256, 256)]


def exactness(device: str) -> dict:
    gen = torch.Generator().manual_seed(11)
    cases, unequal = 0, []
    for i, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            scale = 10.0 ** (i % 5 - 3)
            tensors = [(torch.randn(shape, generator=gen) * scale).to(dtype) for _ in range(3)]
            tensors[0][..., : min(130, shape[-1])] = 0  # an all-zero block
            want = [quantize_block_fp8(t) for t in tensors]
            moved = [t.to(device) for t in tensors]
            # eager: the torch reference itself on `--device` (what quantize_many falls back to)
            ways = {"eager": [quantize_block_fp8(t) for t in moved], "quantize_many": quantize_many(moved)}
            if block_fp8_triton.available(moved[0], BLOCK):
                q, s, _ = block_fp8_triton.quantize_list(moved, BLOCK, block_fp8.AMAX_FLOOR, block_fp8.FP8_E4M3_MAX)
                ways["fused_kernel"] = [(q[j], s[j]) for j in range(len(moved))]
            for way, got in ways.items():
                for (q, s), (rq, rs) in zip(got, want, strict=True):
                    cases += 1
                    if not (torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)):
                        unequal.append(f"{way} {shape} {dtype}")
    return {"cases": cases, "unequal": unequal, "fused_stays_on": block_fp8.DEFAULT_FUSED.enabled}


def _timed(fn, device: str, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def throughput(device: str, experts: int, repeats: int) -> dict:
    tensors = [torch.randn(768, 2048, device=device, dtype=torch.bfloat16) for _ in range(experts)]
    numel = sum(t.numel() for t in tensors)
    runs = {"eager": lambda: quantize_block_fp8(torch.stack(tensors))}
    if block_fp8_triton.available(tensors[0], BLOCK):
        runs["fused"] = lambda: block_fp8_triton.quantize_list(
            tensors, BLOCK, block_fp8.AMAX_FLOOR, block_fp8.FP8_E4M3_MAX
        )
    out = {}
    for name, fn in runs.items():
        seconds = _timed(fn, device, repeats)
        best = min(seconds)
        out[name] = {"seconds": seconds, "g_elements_per_s": numel / best / 1e9}  # = GB/s of FP8 bytes
    if "fused" in out:
        out["fused_over_eager"] = out["fused"]["g_elements_per_s"] / out["eager"]["g_elements_per_s"]
    return {"tensors": experts, "shape": [768, 2048], "dtype": "bfloat16", **out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (CI: the eager path only)")
    parser.add_argument("--experts", type=int, default=128, help="tensors in the throughput run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="JSON report")
    args = parser.parse_args(argv)
    report = {
        "command": "python3 scripts/gpu_fp8_quant_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "exactness": exactness(args.device),
        "throughput": throughput(args.device, args.experts, args.repeats),
    }
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    ex, tp = report["exactness"], report["throughput"]
    print(f"exactness: {ex['cases']} cases, {len(ex['unequal'])} unequal {ex['unequal'][:5]}")
    for name in ("eager", "fused"):
        if name in tp:
            print(f"{name:>6}: {tp[name]['g_elements_per_s']:.1f} G elements/s (= GB/s of FP8 bytes)")
    return 1 if ex["unequal"] else 0


if __name__ == "__main__":
    sys.exit(main())

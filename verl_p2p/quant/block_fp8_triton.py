"""The GPU path of the block-FP8 quantizer: one Triton program per 128x128 block, one read of the input and one
write of the FP8 bytes and the scale, for a whole list of same-shaped tensors in one launch (a layer's experts).

The arithmetic is `block_fp8.quantize_block_fp8`'s, step for step (fp32 amax, the same floor, a correctly rounded
fp32 division by the scale, the same clamp, round-to-nearest-even into e4m3fn), so the bytes are the reference's;
`block_fp8` still checks that on the first GPU batch of each specialization and falls back to the reference
otherwise. The eager torch version makes several passes over the data (upcast, abs, amax, divide, clamp, cast);
its throughput beside this kernel's is in docs/measurements/bench_convert_fp8_h200_qwen3_30b_a3b_tp2ep2.json.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:  # Triton ships with CUDA builds of torch; without it (CPU CI, other accelerators) the reference runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every CUDA torch wheel depends on triton
    triton = None

_INPUTS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def available(x: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether `quantize_list` can take tensors like `x`: a CUDA tensor of a float input dtype, 128x128 blocks."""
    return triton is not None and x.is_cuda and x.dtype in _INPUTS and tuple(block) == (128, 128) and x.dim() == 2


if triton is not None:

    @triton.jit
    def _quantize_blocks(
        inputs,  # int64 [T]: data pointers of T contiguous [N, K] tensors of one dtype
        q_out,  # e4m3fn [T, N, K]
        scale_out,  # fp32 [T, NB, KB]
        bad_out,  # int32 [T], zeroed: NaN/inf elements per tensor (each block adds its own)
        N,
        K,
        NB,
        KB,
        floor,
        fp8_max,
        IN_DTYPE: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = pid // (NB * KB)
        bi = (pid // KB) % NB
        bj = pid % KB
        base = tl.load(inputs + t).to(tl.pointer_type(IN_DTYPE))
        rows = bi * BN + tl.arange(0, BN)
        cols = bj * BK + tl.arange(0, BK)
        mask = (rows[:, None] < N) & (cols[None, :] < K)
        offs = rows[:, None].to(tl.int64) * K + cols[None, :]
        x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        bad = (x != x) | (tl.abs(x) == float("inf"))
        amax = tl.max(tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(amax, floor), fp8_max)
        q = tl.math.div_rn(x, scale)
        q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
        block = (t.to(tl.int64) * NB + bi) * KB + bj
        tl.store(q_out + t.to(tl.int64) * N * K + offs, q.to(tl.float8e4nv), mask=mask)
        tl.store(scale_out + block, scale)
        tl.atomic_add(bad_out + t, tl.sum(bad.to(tl.int32)))


def quantize_list(
    tensors: Sequence[torch.Tensor], block: tuple[int, int], floor: float, fp8_max: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """T same-shaped, same-dtype CUDA tensors [N, K] -> (e4m3fn [T, N, K], fp32 scales [T, NB, KB], NaN/inf count
    per tensor [T]); one launch. The caller refuses non-finite inputs (their blocks' scales are garbage). The counts
    are summed in the kernel: a reduction launch per batch was a visible share of an FP8 conversion's host time
    (docs/measurements/bench_convert_fp8_h200_profile_s9.json)."""
    first = tensors[0]
    n, k = first.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    parts = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    # from pinned memory, so the copy is queued: from pageable memory CUDA waits for the stream first, which made
    # every batch of the FP8 stream wait for the GPU
    table = torch.tensor([t.data_ptr() for t in parts], dtype=torch.int64).pin_memory()
    pointers = table.to(first.device, non_blocking=True)
    q = torch.empty((len(parts), n, k), dtype=torch.float8_e4m3fn, device=first.device)
    scales = torch.empty((len(parts), nb, kb), dtype=torch.float32, device=first.device)
    bad = torch.zeros(len(parts), dtype=torch.int32, device=first.device)
    in_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[first.dtype]
    grid = (len(parts) * nb * kb,)
    _quantize_blocks[grid](
        pointers, q, scales, bad, n, k, nb, kb, floor, fp8_max, IN_DTYPE=in_dtype, BN=bn, BK=bk, num_warps=8
    )
    del parts  # kept alive until the launch is queued (the pointers refer to them)
    return q, scales, bad

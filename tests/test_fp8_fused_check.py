"""The fused FP8 kernel's self-check covers every specialization it runs (finding 16): the first batch of each
(shape, dtype, device, block) is compared with the reference, and a difference in any of them turns it off.

The Triton kernel needs a GPU; here a named stand-in kernel (`WrongOnOneShape`, the reference's own arithmetic,
with one byte flipped for one specialization) is handed to the real `FusedQuantizer` through its parameter."""

from __future__ import annotations

import logging

import torch

from verl_p2p.quant.block_fp8 import AMAX_FLOOR, BLOCK, FP8_E4M3_MAX, FusedQuantizer, quantize_block_fp8, quantize_many


class WrongOnOneShape:
    """Stand-in for `block_fp8_triton` on a CPU host: the reference's bytes, except one flipped byte in every
    tensor of shape `wrong`, as a miscompiled specialization would give."""

    def __init__(self, wrong: tuple[int, int]):
        self.wrong = wrong
        self.calls: list[tuple[tuple[int, ...], torch.dtype]] = []

    def available(self, x: torch.Tensor, block: tuple[int, int]) -> bool:
        return x.dim() == 2 and tuple(block) == BLOCK

    def quantize_list(self, tensors, block, floor, fp8_max):
        assert (floor, fp8_max) == (AMAX_FLOOR, FP8_E4M3_MAX)
        self.calls.append((tuple(tensors[0].shape), tensors[0].dtype))
        q, s = quantize_block_fp8(torch.stack(list(tensors)), block)
        if tuple(tensors[0].shape) == self.wrong:
            q = q.clone()
            q.view(torch.uint8)[:, 0, 0] ^= 1
        return q, s, torch.zeros(len(tensors), dtype=torch.int32)


def _batch(shape, dtype, seed, count=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(count)]


def _reference(tensors):
    return [quantize_block_fp8(t) for t in tensors]


def _same(got, want) -> bool:
    return all(
        torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        for (q, s), (rq, rs) in zip(got, want, strict=True)
    )


def test_a_wrong_later_specialization_is_caught_and_the_reference_used(caplog):
    kernel = WrongOnOneShape(wrong=(130, 300))
    fused = FusedQuantizer(kernel)
    first = _batch((256, 256), torch.float32, 0)  # the process's first batch: right
    assert _same(quantize_many(first, fused=fused), _reference(first))
    assert fused.enabled and len(fused.checked) == 1
    later = _batch((130, 300), torch.bfloat16, 1)  # another shape and dtype: miscompiled
    with caplog.at_level(logging.WARNING, logger="verl_p2p.quant.block_fp8"):
        got = quantize_many(later, names=["w.a", "w.b"], fused=fused)
    assert _same(got, _reference(later))  # the reference's bytes, not the kernel's
    assert not fused.enabled
    assert any("130x300 torch.bfloat16" in r.getMessage() and "w.a" in r.getMessage() for r in caplog.records)
    calls = len(kernel.calls)
    again = _batch((256, 256), torch.float32, 2)
    assert _same(quantize_many(again, fused=fused), _reference(again))
    assert len(kernel.calls) == calls  # off for good: not even the specialization that matched runs it


def test_each_specialization_is_checked_once_and_a_right_kernel_stays_on():
    kernel = WrongOnOneShape(wrong=(1, 1))  # never given that shape: always right
    fused = FusedQuantizer(kernel)
    for shape, dtype in [((256, 256), torch.float32), ((256, 256), torch.bfloat16), ((129, 4097), torch.float16)]:
        batch = _batch(shape, dtype, 3)
        assert _same(quantize_many(batch, fused=fused), _reference(batch))
        assert _same(quantize_many(batch, fused=fused), _reference(batch))
    assert fused.enabled
    assert {(shape, dtype) for shape, dtype, _, _ in fused.checked} == {
        ((256, 256), torch.float32),
        ((256, 256), torch.bfloat16),
        ((129, 4097), torch.float16),
    }
    assert len(kernel.calls) == 6  # every batch ran the kernel: the check only compared the first of each kind


def test_the_default_kernel_does_not_apply_on_cpu():
    """The real Triton kernel takes CUDA tensors only: on this host every batch runs the reference."""
    fused = FusedQuantizer()
    batch = _batch((256, 256), torch.float32, 4)
    assert _same(quantize_many(batch, fused=fused), _reference(batch))
    assert fused.enabled and not fused.checked

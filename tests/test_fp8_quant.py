"""The block-FP8 quantizer (verl_p2p/quant/block_fp8.py) against an independent formula, byte for byte.

The reference here shares nothing with the quantizer: numpy float32 arithmetic for the scale and the division,
and the e4m3fn value table built from the format's bit layout, with exact (Fraction) round-to-nearest-even.
"""

from __future__ import annotations

import bisect
import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from verl_p2p.errors import QuantizationError
from verl_p2p.quant.block_fp8 import BLOCK, BlockFp8Scheme, quantize_block_fp8, quantize_many, raise_if_nonfinite

# --------------------------------------------------------------------------------------- the independent formula


def _e4m3fn_table() -> tuple[list[Fraction], list[int]]:
    """Every finite non-negative e4m3fn value, ascending, with its bit pattern (bias 7, 0x7F is NaN)."""
    pairs = []
    for bits in range(0x7F):
        e, m = bits >> 3, bits & 7
        value = Fraction(m, 8) * Fraction(1, 2**6) if e == 0 else (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)
        pairs.append((value, bits))
    pairs.sort()
    return [v for v, _ in pairs], [b for _, b in pairs]


VALUES, BITS = _e4m3fn_table()
assert VALUES[-1] == 448


def _e4m3_bits(v: np.float32) -> int:
    """Round-to-nearest-even of a float32 |v| <= 448 to e4m3fn, as its byte."""
    sign = 0x80 if np.signbit(v) else 0
    a = Fraction(float(abs(v)))
    i = bisect.bisect_left(VALUES, a)
    if VALUES[i] == a:
        return sign | BITS[i]
    lo, hi = i - 1, i
    d_lo, d_hi = a - VALUES[lo], VALUES[hi] - a
    pick = lo if d_lo < d_hi or (d_lo == d_hi and BITS[lo] % 2 == 0) else hi
    return sign | BITS[pick]


def reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [N, K] -> (uint8 bytes [N, K], float32 scales [ceil(N/128), ceil(K/128)])."""
    n, k = x.shape
    nb, kb = -(-n // 128), -(-k // 128)
    q = np.zeros((n, k), dtype=np.uint8)
    s = np.zeros((nb, kb), dtype=np.float32)
    for bi in range(nb):
        for bj in range(kb):
            blk = x[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
            amax = np.float32(max(float(np.max(np.abs(blk))), float(np.float32(1e-10))))
            scale = np.float32(amax / np.float32(448.0))
            s[bi, bj] = scale
            for (r, c), v in np.ndenumerate(blk):
                y = np.float32(np.float32(v) / scale)
                y = np.float32(min(max(y, np.float32(-448.0)), np.float32(448.0)))
                q[bi * 128 + r, bj * 128 + c] = _e4m3_bits(y)
    return q, s


def assert_matches_reference(x: torch.Tensor) -> None:
    q, s = quantize_block_fp8(x, name="t")
    rq, rs = reference(x.to(torch.float32).numpy())
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(q.shape) == tuple(x.shape) and tuple(s.shape) == rs.shape
    assert np.array_equal(s.numpy().view(np.uint32), rs.view(np.uint32))
    got = q.view(torch.uint8).numpy()
    bad = np.argwhere(got != rq)
    assert len(bad) == 0, (
        f"{len(bad)} bytes differ, first at {bad[0]}: {got[tuple(bad[0])]:#x} != {rq[tuple(bad[0])]:#x}"
    )


# ------------------------------------------------------------------------------------------------ edge values


def test_table_decodes_like_torch():
    """The independent table agrees with torch's e4m3fn decoding (checks the table, not the quantizer)."""
    decoded = torch.tensor(BITS, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).tolist()
    assert decoded == [float(v) for v in VALUES]


def test_zeros_block():
    x = torch.zeros(128, 128)
    x[5, 7] = -0.0
    assert_matches_reference(x)
    q, s = quantize_block_fp8(torch.zeros(128, 256))
    assert (q.view(torch.uint8) == 0).all() and (s == np.float32(1e-10) / np.float32(448)).all()


def test_block_of_one_huge_value():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(128, 256, generator=gen) * 1e-3
    x[17, 3] = 3.0e38  # near fp32 max: everything else in its block flushes to zero or e4m3 subnormals
    x[100, 200] = -6.0e4
    assert_matches_reference(x)
    q, _ = quantize_block_fp8(x)
    assert q.view(torch.uint8)[17, 3] == 0x7E and q.view(torch.uint8)[100, 200] == 0xFE  # +-448


def test_subnormals():
    """fp32 subnormal inputs, and values that land on e4m3 subnormals (and on the round-to-zero boundary)."""
    x = torch.zeros(128, 384)
    x[:, :128] = torch.linspace(-1e-38, 1e-38, 128 * 128).reshape(128, 128)  # fp32 subnormals only
    x[0, 128] = 448.0  # scale 1: then 2**-9 .. 2**-6 are e4m3 subnormals
    x[1, 128:256] = torch.tensor([k * 2.0**-10 for k in range(128)])  # exact ties at odd multiples of 2**-10
    x[2, 128:256] = torch.linspace(-(2.0**-6), 2.0**-6, 128)
    x[:, 256:] = torch.full((128, 128), 1.0e-45)  # the smallest fp32 subnormal, alone in its block
    assert_matches_reference(x)


def test_ragged_edge_blocks_and_bf16():
    gen = torch.Generator().manual_seed(2)
    for shape in ((1, 1), (129, 127), (200, 300), (64, 130)):
        x = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[1])
        assert_matches_reference(x)
        assert_matches_reference(x.to(torch.bfloat16))


def test_edge_block_amax_ignores_the_padding():
    """A ragged edge block whose real elements are all negative: padding zeros must not be its amax."""
    x = -torch.ones(130, 130) * 3.0
    x[128:, 128:] = -5.0
    q, s = quantize_block_fp8(x)
    assert s[1, 1] == np.float32(5.0) / np.float32(448.0)
    assert_matches_reference(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_refused(bad):
    x = torch.ones(256, 256)
    x[200, 3] = bad
    with pytest.raises(QuantizationError, match=r"layers\.0\.q_proj\.weight: 1 NaN/inf value\(s\).*diverged"):
        quantize_block_fp8(x, name="layers.0.q_proj.weight")
    with pytest.raises(QuantizationError, match=r"b: 1 NaN/inf"):  # the batched path names the culprit
        quantize_many([torch.ones(256, 256), x, torch.ones(256, 256)], names=["a", "b", "c"])
    # deferred (no device wait per call): nothing raised, the counts kept; refused later, naming the same tensor
    nonfinite: list = []
    tensors = [torch.ones(256, 256), torch.ones(128, 256), x, torch.ones(256, 256)]
    out = quantize_many(tensors, names=["a", "lone", "b", "c"], nonfinite=nonfinite)
    assert len(out) == 4 and sum(len(names) for names, _ in nonfinite) == 4
    assert torch.equal(out[1][0].view(torch.uint8), quantize_block_fp8(tensors[1])[0].view(torch.uint8))
    with pytest.raises(QuantizationError, match=r"^b: 1 NaN/inf value\(s\).*diverged"):
        raise_if_nonfinite(nonfinite)
    raise_if_nonfinite([(names, counts) for names, counts in nonfinite if "b" not in names])  # the rest is finite


def test_wrong_inputs_refused():
    with pytest.raises(QuantizationError, match="dtype torch.int32"):
        quantize_block_fp8(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(QuantizationError, match=r"shape \(4,\) has no \[N, K\]"):
        quantize_block_fp8(torch.ones(4))


# ------------------------------------------------------------------------------------------ batched == single


def test_batched_gives_the_same_bytes_as_one_call_each():
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(256, 200, generator=gen).to(torch.bfloat16) * (i + 1) for i in range(5)]
    tensors += [torch.randn(130, 128, generator=gen) for _ in range(3)]
    batched = quantize_many(tensors, max_group_bytes=3 * 256 * 200 * 4)  # groups of 3, then 2, and one of 3
    for t, (q, s) in zip(tensors, batched, strict=True):
        q1, s1 = quantize_block_fp8(t)
        assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s, s1)
        assert q.is_contiguous()
    q3, s3 = quantize_block_fp8(torch.stack(tensors[:5]))
    assert torch.equal(q3[4].view(torch.uint8), batched[4][0].view(torch.uint8)) and torch.equal(s3[4], batched[4][1])


# ------------------------------------------------------------------------------------------ which tensors


def test_scheme_selects_the_decoder_linears_minus_ignored():
    scheme = BlockFp8Scheme.from_hf_config(
        {
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
                "modules_to_not_convert": ["lm_head", "model.layers.1.self_attn", "mlp.gate"],
            }
        }
    )
    picked = {
        "model.layers.0.self_attn.q_proj.weight": True,
        "model.layers.0.self_attn.o_proj.weight": True,
        "model.layers.0.mlp.experts.3.gate_proj.weight": True,
        "model.layers.0.mlp.experts.3.down_proj.weight": True,
        "model.layers.0.mlp.gate_proj.weight": True,  # `mlp.gate` is not `mlp.gate_proj`
        "model.layers.0.mlp.gate.weight": False,  # the router
        "model.layers.0.mlp.shared_expert_gate.weight": False,
        "model.layers.1.self_attn.k_proj.weight": False,  # ignored module tree
        "model.layers.1.self_attn.q_norm.weight": False,
        "model.layers.0.input_layernorm.weight": False,
        "model.embed_tokens.weight": False,
        "lm_head.weight": False,
        "model.layers.0.self_attn.kv_b_proj.weight": True,
    }
    for name, expected in picked.items():
        assert scheme.quantizes(name, (256, 256)) is expected, name
    assert not scheme.quantizes("model.layers.0.self_attn.q_proj.bias", (256,))
    assert BlockFp8Scheme.from_hf_config({"vocab_size": 3}) is None


def test_quantize_state_and_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from verl_p2p.trainer.fp8_checkpoint import write_fp8_checkpoint

    gen = torch.Generator().manual_seed(4)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 130, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.gate.weight": torch.randn(8, 130, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.ones(130, dtype=torch.bfloat16),
    }
    path = write_fp8_checkpoint(tmp_path / "ck", {"model_type": "qwen3_moe"}, tensors)
    got = load_file(str(path / "model.safetensors"))
    assert sorted(got) == sorted([*tensors, "model.layers.0.self_attn.q_proj.weight_scale_inv"])
    q, s = quantize_block_fp8(tensors["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight_scale_inv"], s) and s.shape == (2, 2)
    assert torch.equal(got["model.layers.0.mlp.gate.weight"], tensors["model.layers.0.mlp.gate.weight"])
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_exact_division_decides_a_tie():
    """amax 449: s = fp32(449 / 448). x = fp32(1.6875 * s) divides back to exactly the tie 1.6875 (rounds to even,
    1.75); x * fp32(1 / s) lands just below it (1.625). The definition divides; a quantizer multiplying by the
    reciprocal writes other bytes."""
    x = torch.zeros(128, 128)
    x[0, 0] = 449.0
    s = torch.tensor(449.0) / 448.0
    x[0, 1] = torch.tensor(1.6875) * s
    assert float(x[0, 1] / s) == 1.6875 and float(x[0, 1] * (1.0 / s)) < 1.6875
    assert_matches_reference(x)
    q, _ = quantize_block_fp8(x)
    assert float(q[0, 1].to(torch.float32)) == 1.75


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")
def test_cuda_gives_the_cpu_reference_bytes():
    """The device path (same function, batched, on the GPU) writes exactly the CPU reference's bytes."""
    gen = torch.Generator().manual_seed(5)
    tensors = [
        torch.randn(s, generator=gen) * 10.0 ** torch.randint(-6, 4, (1,), generator=gen)
        for s in [(2048, 768)] * 8 + [(768, 2048)] * 8 + [(200, 300), (129, 4097), (1, 1)]
    ]
    tensors += [t.to(torch.bfloat16) for t in tensors[:4]]
    tensors.append(torch.zeros(256, 256))
    on_gpu = quantize_many([t.cuda() for t in tensors])
    for t, (q, s) in zip(tensors, on_gpu, strict=True):
        q1, s1 = quantize_block_fp8(t)
        assert torch.equal(q.cpu().view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s.cpu(), s1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")
def test_fused_gpu_kernel_gives_the_reference_bytes_itself():
    """The one-launch Triton kernel on its own (not through quantize_many's fallback): the reference's bytes for
    ragged edges, every input dtype, zero blocks; its NaN/inf counts; and quantize_many keeps using it."""
    from verl_p2p.quant import block_fp8, block_fp8_triton

    gen = torch.Generator().manual_seed(7)
    for shape, dtype in [((2048, 768), torch.bfloat16), ((200, 300), torch.float32), ((129, 4097), torch.float16)]:
        tensors = [(torch.randn(shape, generator=gen) * 10.0 ** (i - 3)).to(dtype) for i in range(4)]
        tensors[0][:, :130] = 0
        q, s, bad = block_fp8_triton.quantize_list(
            [t.cuda() for t in tensors], BLOCK, block_fp8.AMAX_FLOOR, block_fp8.FP8_E4M3_MAX
        )
        assert int(bad.sum()) == 0
        for j, t in enumerate(tensors):
            rq, rs = quantize_block_fp8(t)
            assert torch.equal(q[j].cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s[j].cpu(), rs)
    t = torch.randn(130, 130)
    t[3, 4], t[129, 129] = float("nan"), float("inf")
    _, _, bad = block_fp8_triton.quantize_list([t.cuda()], BLOCK, block_fp8.AMAX_FLOOR, block_fp8.FP8_E4M3_MAX)
    assert bad.cpu().tolist() == [2]  # one NaN, one inf: counted per tensor, in the kernel
    _, _, bad = block_fp8_triton.quantize_list(
        [torch.randn(130, 130).cuda(), t.cuda(), torch.randn(130, 130).cuda()],
        BLOCK,
        block_fp8.AMAX_FLOOR,
        block_fp8.FP8_E4M3_MAX,
    )
    assert bad.cpu().tolist() == [0, 2, 0]  # each tensor's own count, none spilling into its neighbours
    with pytest.raises(QuantizationError, match="NaN/inf"):
        quantize_many([t.cuda(), torch.randn(130, 130).cuda()], names=["w.nan", "w.ok"])
    quantize_many([torch.randn(256, 256).cuda() for _ in range(3)])
    assert block_fp8.DEFAULT_FUSED.enabled  # each specialization's first batch matched the reference: it stays on
    assert (torch.Size([256, 256]), torch.float32) in {key[:2] for key in block_fp8.DEFAULT_FUSED.checked}
    nonfinite: list = []  # the deferred path through the kernel: no wait per call, the culprit named later
    quantize_many([torch.randn(130, 130).cuda(), t.cuda()], names=["w.ok", "w.nan"], nonfinite=nonfinite)
    with pytest.raises(QuantizationError, match=r"^w\.nan: 2 NaN/inf"):
        block_fp8.raise_if_nonfinite(nonfinite)
    assert block_fp8.warm_up([(768, 2048), (4, 768, 2048), (130, 130)], (torch.bfloat16,), torch.device("cuda")) == 2


def test_fp8_warm_up_takes_the_shapes_the_push_quantizes(monkeypatch):
    """Before the pause, the trainer compiles the GPU quantizer for every planned FP8 weight's [N, K] (nothing on
    a CPU host: the reference runs there)."""
    from types import SimpleNamespace

    from verl_p2p.quant import block_fp8
    from verl_p2p.trainer import source

    assert block_fp8.warm_up([(256, 256)], (torch.bfloat16,), torch.device("cpu")) == 0
    seen = []
    monkeypatch.setattr(block_fp8, "warm_up", lambda shapes, dtypes, device: seen.append((set(shapes), dtypes)))
    planned = {
        "model.layers.0.mlp.down_proj.weight": ((2048, 768), torch.float8_e4m3fn),
        "model.layers.0.mlp.down_proj.weight_scale_inv": ((16, 6), torch.float32),
        "model.layers.0.self_attn.q_proj.weight": ((4096, 2048), torch.float8_e4m3fn),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": ((32, 16), torch.float32),
        "model.norm.weight": ((2048,), torch.bfloat16),
    }
    source._warm_fp8_quantizer([SimpleNamespace(plan=SimpleNamespace(hf_specs=planned))])
    assert seen == [({(2048, 768), (4096, 2048)}, (torch.bfloat16, torch.float32))]
    seen.clear()
    source._warm_fp8_quantizer(
        [SimpleNamespace(plan=SimpleNamespace(hf_specs={"model.norm.weight": planned["model.norm.weight"]}))]
    )
    assert seen == []  # a bf16 rollout: nothing to warm

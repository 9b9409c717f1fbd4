"""128x128 block-FP8 (e4m3fn) quantization: the one definition of the arithmetic, and which tensors it applies to.

A rollout serving a block-FP8 checkpoint (Qwen3-*-FP8, DeepSeek-V3, Kimi-K2) holds, on Hopper, the loader's
slices of the checkpoint's bytes unchanged: `weight` e4m3fn [N, K] and `weight_scale_inv` fp32
[ceil(N/128), ceil(K/128)], the dequantization multiplier of each block. The trainer holds bf16; p2p is exact
when the trainer quantizes each such tensor with this function and the rollout was started from a checkpoint
quantized by the same function. Per block: s = max(amax, 1e-10) / 448 (fp32), q = clamp(x / s, +-448) cast to
e4m3fn (round to nearest even). Every step is an IEEE-exact torch op (abs, max, fp32 division, clamp, the
cast), so the CPU reference and a GPU run give identical bytes; `quantize_many` batches tensors of one shape
into one call of the same function.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from verl_p2p.errors import QuantizationError

BLOCK = (128, 128)
logger = logging.getLogger(__name__)

FP8_E4M3_MAX = 448.0
AMAX_FLOOR = 1e-10  # an all-zero block gets a tiny positive scale (its bytes are zeros either way)
SCALE_SUFFIX = "weight_scale_inv"
FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)

# The linear projections SGLang builds with the checkpoint's quant config (LinearBase / FusedMoE experts) in the
# supported decoder families. Routers (`mlp.gate`, `shared_expert_gate`), embeddings, lm_head and norms are not
# linear projections of the decoder layers and stay in the checkpoint's dtype.
LINEAR_LEAVES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
    }
)
_LAYER = re.compile(r"^model\.layers\.\d+\.")

# quantization_config keys whose values the quantizer reproduces; any other key may change the weight bytes.
_KNOWN_KEYS = frozenset(
    {"quant_method", "fmt", "activation_scheme", "weight_block_size", "ignored_layers", "modules_to_not_convert"}
)


def quantize_block_fp8(
    x: torch.Tensor, block: tuple[int, int] = BLOCK, name: str = "tensor", check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N, K] (fp32/bf16/fp16, any device) -> (e4m3fn [..., N, K], fp32 scales [..., ceil(N/bn), ceil(K/bk)]).

    Edge blocks (N or K not a multiple of the block) take the amax of their real elements only. A NaN or inf
    anywhere is refused: it would poison its block's scale and every byte of the block. `check=False` leaves that
    to the caller (`quantize_many(nonfinite=...)`), which saves the device sync the check costs.
    """
    if x.dtype not in FLOAT_INPUTS:
        raise QuantizationError(f"{name}: dtype {x.dtype} cannot be block-FP8 quantized; pass one of {FLOAT_INPUTS}")
    if x.dim() < 2:
        raise QuantizationError(f"{name}: shape {tuple(x.shape)} has no [N, K] matrix to quantize in blocks")
    bn, bk = block
    *lead, n, k = x.shape
    nb, kb = -(-n // bn), -(-k // bk)
    xf = x.to(torch.float32)
    if n % bn or k % bk:
        padded = torch.zeros((*lead, nb * bn, kb * bk), dtype=torch.float32, device=x.device)
        padded[..., :n, :k] = xf
        xf = padded
    blocks = xf.reshape(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1))  # NaN propagates into its block's amax, inf stays inf
    if check and not bool(torch.isfinite(amax).all()):
        raise QuantizationError(_nonfinite_message(name, int((~torch.isfinite(x)).sum())))
    # a tensor divisor, not the Python float: CUDA torch divides by a CPU scalar as a multiply by its reciprocal,
    # which is not the correctly rounded quotient (the eager GPU bytes differed from the CPU's: docs/measurements/
    # fp8_quant_h200.json); tensor / tensor is IEEE division on every device, as the Triton kernel's div_rn
    scale = amax.clamp(min=AMAX_FLOOR) / torch.full_like(amax, FP8_E4M3_MAX)
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, nb * bn, kb * bk)
    if n % bn or k % bk:
        q = q[..., :n, :k]
    return q.contiguous(), scale


class FusedKernel(Protocol):
    """A one-launch quantizer of same-shaped tensors (`block_fp8_triton` is the real one)."""

    def available(self, x: torch.Tensor, block: tuple[int, int]) -> bool: ...

    def quantize_list(
        self, tensors: Sequence[torch.Tensor], block: tuple[int, int], floor: float, fp8_max: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class FusedQuantizer:
    """A fused kernel that checks itself: the first batch of each specialization it runs ((N, K), input dtype,
    device, block: what Triton compiles separately) is compared byte for byte with the reference
    (`quantize_block_fp8`). A difference anywhere turns the kernel off for good (logged): one wrong specialization
    makes every other suspect, and the reference is always right. `kernel` None: `block_fp8_triton`."""

    def __init__(self, kernel: FusedKernel | None = None):
        self._kernel = kernel
        self.checked: set[tuple] = set()  # specializations whose first batch matched the reference
        self.enabled = True

    @property
    def kernel(self) -> FusedKernel:
        if self._kernel is None:
            from verl_p2p.quant import block_fp8_triton

            self._kernel = block_fp8_triton
        return self._kernel

    def __call__(self, tensors, chunk, block, names, nonfinite=None) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The chunk through the kernel, or None where it does not apply (then the caller runs the reference)."""
        first = tensors[chunk[0]]
        if not self.enabled or not self.kernel.available(first, block):
            return None
        q, s, bad = self.kernel.quantize_list([tensors[i] for i in chunk], block, AMAX_FLOOR, FP8_E4M3_MAX)
        if nonfinite is not None:  # refused later, without a wait here
            nonfinite.append(([names[i] for i in chunk], bad))
        elif bool(bad.any()):  # the reference names the tensor and refuses it
            for i in chunk:
                quantize_block_fp8(tensors[i], block, names[i])
        pairs = list(zip(q.unbind(0), s.unbind(0), strict=True))  # one call for all the views, not two per tensor
        specialization = (tuple(first.shape), first.dtype, first.device, tuple(block))
        if specialization not in self.checked:
            for i, (qj, sj) in zip(chunk, pairs, strict=True):
                rq, rs = quantize_block_fp8(tensors[i], block, names[i])
                if not (torch.equal(qj.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sj, rs)):
                    self.enabled = False
                    logger.warning(
                        "the fused GPU FP8 quantizer's bytes differ from the reference for %s %s on %s (%s): using "
                        "the reference (slower) for the rest of this process",
                        "x".join(map(str, first.shape)),
                        first.dtype,
                        first.device,
                        names[i],
                    )
                    return None
            self.checked.add(specialization)
        return pairs


# The quantizer `quantize_many` uses unless handed another. Process-wide on purpose: whether the kernel gives the
# reference's bytes is a fact of this process's GPU and Triton build, the same for every caller, and each
# specialization is compiled once per process, so one owner per process checks each once.
DEFAULT_FUSED = FusedQuantizer()


def quantize_many(
    tensors: Sequence[torch.Tensor],
    block: tuple[int, int] = BLOCK,
    names: Sequence[str] | None = None,
    max_group_bytes: int = 1 << 30,
    nonfinite: list | None = None,
    fused: FusedQuantizer | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`quantize_block_fp8` of every tensor, tensors of one shape, dtype and device stacked into one call
    (MoE experts: one call per projection kind instead of one per expert). Same bytes as one call each.

    NaN/inf inputs are refused here, which waits for the device. With `nonfinite` (a list) nothing waits: each
    call appends its tensors' names and their NaN/inf counts (a device tensor), and `raise_if_nonfinite` refuses
    them later, once, with the same message (the FP8 stream of a push: its work stays queued on the GPU).
    `fused`: the self-checking fused kernel to try first (default `DEFAULT_FUSED`)."""
    fused_kernel = DEFAULT_FUSED if fused is None else fused
    names = list(names) if names is not None else [f"tensor {i}" for i in range(len(tensors))]
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):  # torch.Size hashes as the tuple it is
        groups.setdefault((t.shape, t.dtype, t.device), []).append(i)
    for members in groups.values():
        per = max(1, max_group_bytes // max(1, tensors[members[0]].numel() * 4))
        for start in range(0, len(members), per):
            chunk = members[start : start + per]
            done = fused_kernel(tensors, chunk, block, names, nonfinite)
            if done is not None:
                for j, i in enumerate(chunk):
                    out[i] = done[j]
                continue
            x = tensors[chunk[0]] if len(chunk) == 1 else torch.stack([tensors[i] for i in chunk])
            if nonfinite is not None:
                q, s = quantize_block_fp8(x, block, names[chunk[0]], check=False)
                counts = (~torch.isfinite(x)).reshape(len(chunk), -1).sum(dim=1)
                nonfinite.append(([names[i] for i in chunk], counts))
            elif len(chunk) == 1:
                q, s = quantize_block_fp8(x, block, names[chunk[0]])
            else:
                try:
                    q, s = quantize_block_fp8(x, block, f"{len(chunk)} tensors")
                except QuantizationError:  # name the culprit
                    for i in chunk:
                        quantize_block_fp8(tensors[i], block, names[i])
                    raise
            if len(chunk) == 1:
                out[chunk[0]] = (q, s)
                continue
            for j, i in enumerate(chunk):
                out[i] = (q[j], s[j])
    return out  # type: ignore[return-value]


def raise_if_nonfinite(nonfinite: Sequence[tuple[Sequence[str], torch.Tensor]]) -> None:
    """Refuse, naming the first tensor, what `quantize_many(nonfinite=...)` recorded: one wait per device."""
    by_device: dict[torch.device, list[tuple[Sequence[str], torch.Tensor]]] = {}
    for names, counts in nonfinite:
        by_device.setdefault(counts.device, []).append((names, counts))
    for entries in by_device.values():
        counts = torch.cat([c.reshape(-1).to(torch.int64) for _, c in entries]).tolist()
        named = [n for names, _ in entries for n in names]
        for name, bad in zip(named, counts, strict=True):
            if bad:
                raise QuantizationError(_nonfinite_message(name, bad))


def _nonfinite_message(name: str, bad: int) -> str:
    return (
        f"{name}: {bad} NaN/inf value(s) cannot be quantized to FP8 (their blocks' scales would be NaN/inf); "
        "the trainer's weights diverged: fix the step that produced them before syncing"
    )


def scale_name(weight_name: str) -> str:
    """`...q_proj.weight` -> `...q_proj.weight_scale_inv` (the checkpoint name of its block scales)."""
    return weight_name.removesuffix("weight") + SCALE_SUFFIX


def _path_match(ignored: str, module: str) -> bool:
    """`ignored` names `module` or a module above it, on dotted-path boundaries (`mlp.gate` is not `mlp.gate_up`)."""
    return ("." + ignored + ".") in ("." + module + ".")


@dataclass(frozen=True)
class BlockFp8Scheme:
    """A checkpoint's block-FP8 quantization as the quantizer reproduces it: block size and not-converted modules.

    `from_hf_config` refuses every quantization_config whose weight bytes this quantizer would not reproduce.
    """

    block: tuple[int, int]
    ignored: tuple[str, ...] = ()
    activation_scheme: str = "dynamic"

    @classmethod
    def from_hf_config(cls, hf_config: Mapping) -> BlockFp8Scheme | None:
        """The scheme of `hf_config`'s `quantization_config`; None for an unquantized checkpoint."""
        qc = hf_config.get("quantization_config")
        if not qc:
            return None
        return cls.from_quantization_config(qc)

    @classmethod
    def from_quantization_config(cls, qc: Mapping) -> BlockFp8Scheme:
        fix = "quantize the rollout checkpoint with `verl_p2p.trainer.fp8_checkpoint` (128x128 block FP8) or serve bf16"
        method = qc.get("quant_method")
        if method != "fp8":
            raise QuantizationError(
                f"quantization_config.quant_method={method!r}: the trainer's quantizer writes block FP8 "
                f"(quant_method 'fp8') only; {fix}"
            )
        unknown = sorted(set(qc) - _KNOWN_KEYS)
        if unknown:
            raise QuantizationError(
                f"quantization_config keys {unknown} may change the weight bytes (e.g. scale_fmt ue8m0) and the "
                f"quantizer does not reproduce them; {fix}"
            )
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantizationError(f"quantization_config.fmt={fmt!r}: only e4m3 (float8_e4m3fn) is written; {fix}")
        act = qc.get("activation_scheme", "dynamic")
        if act != "dynamic":
            raise QuantizationError(
                f"quantization_config.activation_scheme={act!r}: static activation scales (input_scale) come from "
                f"calibration, not from the weights; use activation_scheme 'dynamic' ({fix})"
            )
        block = qc.get("weight_block_size")
        if block is None:
            raise QuantizationError(
                "quantization_config has no weight_block_size (per-tensor/per-channel FP8): its scales are not the "
                f"128x128 blocks the quantizer writes; {fix}"
            )
        if list(block) != list(BLOCK):
            raise QuantizationError(
                f"quantization_config.weight_block_size={list(block)}: the quantizer writes {list(BLOCK)} blocks "
                f"only; {fix}"
            )
        ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()
        return cls(block=tuple(BLOCK), ignored=tuple(str(m).removeprefix("model.") for m in ignored))

    def quantization_config(self) -> dict:
        """The config.json `quantization_config` of a checkpoint this scheme writes."""
        qc = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": self.activation_scheme,
            "weight_block_size": list(self.block),
        }
        if self.ignored:
            qc["ignored_layers"] = list(self.ignored)
        return qc

    def quantizes(self, name: str, shape: Iterable[int]) -> bool:
        """Whether the checkpoint stores HF tensor `name` (of `shape`) as FP8 with a `weight_scale_inv` beside it."""
        if not name.endswith(".weight") or len(tuple(shape)) != 2 or not _LAYER.match(name):
            return False
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in LINEAR_LEAVES:
            return False
        bare = module.removeprefix("model.")
        return not any(_path_match(ignored, bare) for ignored in self.ignored)

    def checkpoint_specs(self, specs: Mapping[str, tuple]) -> dict[str, tuple]:
        """HF specs {name: (shape, dtype)} -> the specs of the checkpoint this scheme writes: each quantized weight
        as e4m3fn with its fp32 `weight_scale_inv` (one per block) after it, every other tensor unchanged."""
        out: dict[str, tuple] = {}
        for name, (shape, dtype) in specs.items():
            if self.quantizes(name, shape):
                out[name] = (tuple(shape), torch.float8_e4m3fn)
                blocks = tuple(-(-int(d) // b) for d, b in zip(shape, self.block, strict=True))
                out[scale_name(name)] = (blocks, torch.float32)
            else:
                out[name] = (shape, dtype)
        return out

    def quantize_state(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF tensors -> the checkpoint's tensors: each selected `X.weight` as e4m3fn plus `X.weight_scale_inv`,
        every other tensor unchanged. The selected tensors are quantized in batches (`quantize_many`)."""
        chosen = [n for n, t in tensors.items() if self.quantizes(n, t.shape)]
        results = quantize_many([tensors[n] for n in chosen], self.block, chosen)
        quantized = dict(zip(chosen, results, strict=True))
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name in quantized:
                q, s = quantized[name]
                out[name] = q
                out[scale_name(name)] = s
            else:
                out[name] = t
        return out


def warm_up(shapes: Iterable[tuple[int, ...]], dtypes: Iterable[torch.dtype], device: torch.device) -> int:
    """Run the GPU quantizer once per distinct [N, K] and input dtype a push will quantize, on seeded tensors:
    Triton compiles a kernel per specialization (and its first batch is checked against the reference) at the
    first call, about half a second that would otherwise fall inside the first sync's pause. Returns the calls."""
    if device.type != "cuda":
        return 0  # the reference runs there: nothing to compile
    generator = torch.Generator(device=device).manual_seed(0)
    calls = 0
    for n, k in sorted({tuple(s[-2:]) for s in shapes}):
        for dtype in dtypes:
            x = torch.randn((n, k), generator=generator, device=device).to(dtype)
            quantize_many([x, x], BLOCK, [f"warm-up {n}x{k} {dtype}"] * 2)
            calls += 1
    torch.cuda.synchronize(device)
    return calls

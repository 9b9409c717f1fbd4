"""Block-FP8 rollouts in the replica: which quantizations it reproduces, and the rank's SGLang quant config.

A rollout started from a 128x128 block-FP8 checkpoint holds, on Hopper, the loader's slices of the checkpoint's
e4m3fn weights and fp32 `weight_scale_inv` unchanged after loading; the replica builds the rank's model with the
same quant config SGLang's loader derives from the checkpoint, so its write plan captures those parameters.
Everything else that changes weight bytes on the rollout GPU after loading is refused here, before a byte
moves: online quantization of a bf16 checkpoint (`--quantization fp8` and friends re-allocate parameters),
quantizations the trainer's quantizer (`verl_p2p.quant.block_fp8`) cannot reproduce, and platforms whose
post-load processing rewrites FP8 bytes (ROCm's e4m3fnuz normalisation, Blackwell's UE8M0 scale re-packing),
decided on the rollout's own GPU where its server launches and on the trainer's for the replica's planning.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from verl_p2p.errors import QuantizationError, UnsupportedLayoutError
from verl_p2p.quant.block_fp8 import BlockFp8Scheme

FIX = (
    "write the rollout's checkpoint with verl_p2p.trainer.fp8_checkpoint (128x128 block FP8 from the trainer's "
    "weights) and start the rollout from it without --quantization, or serve the rollout in bf16"
)


def quantization_problems(server_args: Mapping[str, Any], hf: Mapping[str, Any]) -> list[str]:
    """Why the replica cannot reproduce this rollout's quantized weights (empty: unquantized or block FP8)."""
    online = server_args.get("quantization")
    qc = hf.get("quantization_config")
    if online and not qc:
        return [
            f"quantization={online!r} on an unquantized checkpoint: SGLang quantizes online on the rollout GPU "
            f"after loading, into new parameters (the published addresses go stale); {FIX}"
        ]
    if not qc:
        return []
    try:
        BlockFp8Scheme.from_quantization_config(qc)
    except QuantizationError as e:
        return [f"the checkpoint's quantization cannot be reproduced: {e}"]
    if online and online != "fp8":
        return [
            f"quantization={online!r} on a block-FP8 checkpoint: only the checkpoint's own 'fp8' is reproduced; "
            "drop --quantization (SGLang reads the checkpoint's quantization_config)"
        ]
    return []


@dataclass(frozen=True)
class Fp8Platform:
    """What SGLang decides from the GPU it runs on that changes FP8 bytes after loading."""

    hip: bool  # torch built for ROCm: SGLang normalises e4m3fn to e4m3fnuz
    scale_ue8m0: bool  # DeepGEMM's UE8M0 scales (Blackwell): SGLang re-packs weight_scale_inv

    @classmethod
    def local(cls) -> Fp8Platform:
        """This process's GPU, as SGLang sees it (imports SGLang's DeepGEMM wrapper)."""
        import torch

        try:
            from sglang.srt.layers import deep_gemm_wrapper
        except ImportError:  # pragma: no cover - every supported release has it
            deep_gemm_wrapper = None
        return cls(
            hip=bool(getattr(torch.version, "hip", None)),
            scale_ue8m0=bool(getattr(deep_gemm_wrapper, "DEEPGEMM_SCALE_UE8M0", False)),
        )


def fp8_platform_problem(platform: Fp8Platform) -> str | None:
    """Why block-FP8 bytes written by p2p would not be what SGLang serves on `platform`, or None (Hopper)."""
    if platform.hip:
        return (
            "block-FP8 rollout on ROCm: SGLang normalises e4m3fn weights to e4m3fnuz after loading (and again at "
            "every weight update), so the bytes are not the checkpoint's; p2p FP8 supports CUDA Hopper rollouts; "
            "serve the rollout in bf16 on ROCm"
        )
    if platform.scale_ue8m0:
        return (
            "block-FP8 rollout on Blackwell (sm100/sm120): SGLang re-quantizes the weights' scales to UE8M0 and "
            "re-packs weight_scale_inv after loading, so the rollout's bytes are not the checkpoint's; p2p FP8 "
            "supports Hopper (sm90) scale layouts; serve the rollout in bf16 on Blackwell"
        )
    return None


def check_fp8_platform(platform: Fp8Platform, where: str) -> None:
    problem = fp8_platform_problem(platform)
    if problem is not None:
        raise QuantizationError(f"{where}: {problem}")


def check_local_platform() -> None:
    """Refuse to plan FP8 replicas with an SGLang whose GPU rewrites FP8 bytes (ROCm, Blackwell): the replica runs
    SGLang's loader on the trainer, which derives its layouts from the trainer's GPU. This says nothing about the
    rollout's GPU: that is checked where the rollout runs, before its server launches
    (`rollout.launch.check_server_process`). Nothing later catches a rollout GPU the launch check did not see:
    verify_first_push compares the replica with SGLang's loader, both on the trainer."""
    check_fp8_platform(Fp8Platform.local(), "the trainer's SGLang, which plans the FP8 replica")


def rank_quant_config(model_config: Any, load_config: Any) -> Any:
    """The quant config SGLang's own loader builds for this rank (None for an unquantized checkpoint)."""
    if getattr(model_config, "quantization", None) is None:
        return None
    check_local_platform()
    from sglang.srt.model_loader.loader import _get_quantization_config

    return _get_quantization_config(model_config, load_config)


@contextmanager
def block_rule_refusal(layout: Any) -> Iterator[None]:
    """SGLang's own rule, raised while it creates a rank's FP8 weights: every TP shard of a block-quantized
    projection is a multiple of the block. The rollout cannot start with such a layout either; name the fix.
    Also puts torch's default dtype back when the build fails (SGLang's `set_default_torch_dtype` does not)."""
    import torch

    default_dtype = torch.get_default_dtype()
    try:
        yield
    except BaseException as e:
        torch.set_default_dtype(default_dtype)
        if not isinstance(e, ValueError) or "is not divisible by" not in str(e) or "block" not in str(e):
            raise
        raise UnsupportedLayoutError(
            f"block-FP8 rollout rank {layout}: {e} (SGLang's rule: every TP shard of a 128x128 block-quantized "
            "weight is a multiple of 128). Fix: a tp_size (or ep_size / moe TP) whose shards are multiples of 128; "
            "for a shared expert or a dense MLP, start the rollout with SGLANG_SHARED_EXPERT_TP1=1 / "
            "--moe-dense-tp-size 1 (each rank holds it whole); or serve the rollout in bf16"
        ) from e

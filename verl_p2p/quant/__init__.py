"""Block-FP8 arithmetic shared by the trainer and the replica: bf16/fp32 -> e4m3fn with one fp32 scale per block.

Pure torch (no SGLang, no I/O): `block_fp8` holds the one definition of the arithmetic and the rule of which
HF tensors a rollout checkpoint's `quantization_config` stores as FP8.
"""

from verl_p2p.quant.block_fp8 import (
    BLOCK,
    FP8_E4M3_MAX,
    SCALE_SUFFIX,
    BlockFp8Scheme,
    quantize_block_fp8,
    quantize_many,
)

__all__ = ["BLOCK", "FP8_E4M3_MAX", "SCALE_SUFFIX", "BlockFp8Scheme", "quantize_block_fp8", "quantize_many"]

"""Write the trainer's HF tensors as a block-FP8 HF checkpoint (safetensors + config.json) a fresh SGLang loads.

That checkpoint is the witness of an FP8 sync: a rollout started from it holds exactly the bytes p2p writes
after the same weights, because both go through `verl_p2p.quant.block_fp8` (same arithmetic, same tensors).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from verl_p2p.quant.block_fp8 import BLOCK, BlockFp8Scheme

DEFAULT_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
}


def fp8_checkpoint_model(hf_config: Mapping, specs: Mapping, quantization_config: Mapping | None = None) -> tuple:
    """(config, tensor specs) of the block-FP8 checkpoint `write_fp8_checkpoint` would write for a model with this
    config and these HF tensor specs (name -> (shape, dtype)), without quantizing anything: what a plan or a
    benchmark of an FP8 rollout is built from."""
    qc = dict(quantization_config or DEFAULT_QUANTIZATION_CONFIG)
    return {**hf_config, "quantization_config": qc}, BlockFp8Scheme.from_quantization_config(qc).checkpoint_specs(specs)


def write_fp8_checkpoint(
    path: str | os.PathLike,
    hf_config: Mapping,
    tensors: Mapping[str, torch.Tensor],
    quantization_config: Mapping | None = None,
) -> Path:
    """Quantize `tensors` (HF names, bf16/fp32, any device) and write config.json + model.safetensors to `path`.

    `quantization_config` (default: 128x128 e4m3 dynamic, nothing ignored) goes into config.json as is, after
    `BlockFp8Scheme` accepted it; tensors it does not quantize are written unchanged.
    """
    from safetensors.torch import save_file

    qc = dict(quantization_config or DEFAULT_QUANTIZATION_CONFIG)
    scheme = BlockFp8Scheme.from_quantization_config(qc)
    out = scheme.quantize_state(tensors)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in out.items()}, str(path / "model.safetensors"), {"format": "pt"}
    )
    config = dict(hf_config)
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def quantize_checkpoint(
    src: str | os.PathLike, dst: str | os.PathLike, quantization_config: Mapping | None = None
) -> Path:
    """A bf16/fp32 HF checkpoint directory (config.json + *.safetensors) -> its block-FP8 copy at `dst`."""
    from safetensors.torch import load_file

    src = Path(src)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    hf_config = json.loads((src / "config.json").read_text())
    dst = write_fp8_checkpoint(dst, hf_config, tensors, quantization_config)
    for extra in src.iterdir():  # tokenizer, generation config, ...: everything but the weights and their index
        if extra.is_file() and extra.name != "config.json" and not extra.name.startswith("model.safetensors"):
            if not extra.name.endswith(".safetensors"):
                (dst / extra.name).write_bytes(extra.read_bytes())
    return dst

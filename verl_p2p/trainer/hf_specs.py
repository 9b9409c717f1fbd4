"""Names, shapes and dtypes of a HF checkpoint's tensors, read from safetensors headers (no tensor data).

The trainer-side replica needs every rollout rank's write plan before the first byte streams, so it needs the
checkpoint's tensor list up front; the rollout loaded that same checkpoint, so its headers are the truth.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

HFSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]


def read_safetensors_header(path: str | Path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def hf_specs_from_checkpoint(model_dir: str | Path) -> HFSpecs:
    """`{hf name: (shape, dtype)}` of every tensor in `model_dir/*.safetensors`."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {model_dir}: p2p needs the HF checkpoint the rollout loaded"
        )
    specs: HFSpecs = {}
    for file in files:
        for name, entry in read_safetensors_header(file).items():
            if name == "__metadata__":
                continue
            specs[name] = (tuple(entry["shape"]), _DTYPES[entry["dtype"]])
    return specs

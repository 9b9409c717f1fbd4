"""The bench's synthetic models: their shapes and a deterministic HF tensor stream (no checkpoint on disk)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the stream, not by `verl-p2p bench --help`
    import torch

# Qwen3-30B-A3B's published shape (its model card); the conversion bench runs a few of its layers.
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    num_hidden_layers=48,
    num_experts=128,
    moe_intermediate_size=768,
    vocab_size=151936,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
)


@dataclass(frozen=True)
class BenchShape:
    """A Qwen3-MoE scaled so the whole checkpoint is about 1.2 GB in bf16."""

    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_experts: int = 16
    moe_intermediate_size: int = 512
    vocab_size: int = 32768
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 64

    def config(self) -> dict:
        from verl_p2p.sandbox.tiny import tiny_config_dict

        return tiny_config_dict(
            "qwen3_moe",
            hidden_size=self.hidden_size,
            intermediate_size=4 * self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_experts=self.num_experts,
            num_experts_per_tok=2,
            moe_intermediate_size=self.moe_intermediate_size,
            vocab_size=self.vocab_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            torch_dtype="bfloat16",
        )


MODELS = ("bench", "qwen3-30b-a3b", "tiny")


def model_shape(model: str, layers: int | None = None, experts: int | None = None) -> BenchShape:
    """The bench's synthetic model (about 1.2 GB bf16), Qwen3-30B-A3B's published shape with `layers`
    decoder layers (default: 24 for the bench model, 4 for Qwen3-30B-A3B: about 6 GB), or a tiny one for
    smoke runs (under 4 MB)."""
    if model == "bench":
        base = BenchShape()
    elif model == "tiny":
        base = BenchShape(
            hidden_size=128,
            num_hidden_layers=2,
            num_experts=4,
            moe_intermediate_size=64,
            vocab_size=1024,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
        )
    elif model == "qwen3-30b-a3b":
        base = BenchShape(**{**QWEN3_30B_A3B, "num_hidden_layers": 4})
    else:
        raise ValueError(f"unknown bench model {model!r}; choose one of {list(MODELS)}")
    changes = {}
    if layers is not None:
        changes["num_hidden_layers"] = layers
    if experts is not None:
        changes["num_experts"] = experts
    return replace(base, **changes)


class SyntheticStream:
    """Random bf16 HF tensors, deterministic per name (so the receivers' bytes can be checked): views of one
    random pool, so producing them costs nothing (an export's cost is not the data plane's). Each view is
    a new tensor object per sync, so the staging accounting sees how long the push keeps it alive."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], seed: int = 0) -> None:
        import torch

        self.specs = specs
        largest = max(numel(s) for s, _ in specs.values())
        gen = torch.Generator().manual_seed(seed)
        self.pool = (torch.randn(largest + 4096, generator=gen) * 0.02).to(torch.bfloat16)

    def tensor(self, name: str) -> torch.Tensor:
        shape, dtype = self.specs[name]
        n = numel(shape)
        start = zlib.crc32(name.encode()) % (self.pool.numel() - n + 1)
        return self.pool[start : start + n].view(shape).to(dtype)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.specs:
            yield name, self.tensor(name)


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

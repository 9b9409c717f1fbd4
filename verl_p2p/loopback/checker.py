"""`weights_checker` actions over one rank's real tensors, with SGLang's semantics (utils/weight_checker.py).

The model state is every parameter and buffer. `reset_tensors` overwrites it with random values except
non-persistent buffers (rotary caches, ...), `_skip_weight_check` tensors and the skip list; `compare` checks
it against the snapshot. One deliberate difference: equality is bitwise (SGLang compares values, so it
would accept -0.0 for 0.0), which is what a byte-exact weight transfer must achieve.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

# Union of the patterns of SGLang 0.5.12 and 0.5.23.
NON_PERSISTENT_BUFFER_PATTERNS = (
    "cos_sin_cache",
    "cos_cache",
    "sin_cache",
    "inv_freq",
    "freqs_cis",
    "_weight_fp32",
    "expert_mask_gpu",
)


class CheckFailed(Exception):
    """A checker action failed; the message is what the HTTP answer reports."""


@dataclass(frozen=True)
class Placement:
    """Where the rank sits, reported with checksums like SGLang's `parallelism_info`."""

    tp_rank: int
    tp_size: int
    dp_rank: int = 0
    dp_size: int = 1


def _is_skipped(name: str, tensor: torch.Tensor, skip_tensor_list: Sequence[str]) -> bool:
    return (
        any(p in name for p in NON_PERSISTENT_BUFFER_PATTERNS)
        or getattr(tensor, "_skip_weight_check", False)
        or any(p in name for p in skip_tensor_list)
    )


def _random_like(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.rand(t.shape, dtype=torch.float32).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(t.shape) > 0.5
    info = torch.iinfo(t.dtype)
    return torch.randint(int(info.min), int(info.max), t.shape, dtype=t.dtype)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def tensor_digest(t: torch.Tensor) -> str:
    """16 hex digits of sha256 over the tensor's bytes (SGLang hashes differently; values are not comparable)."""
    return hashlib.sha256(_bytes_of(t).numpy().tobytes()).hexdigest()[:16]


class WeightChecker:
    """Snapshot / reset / compare / checksum of one model's parameters and buffers."""

    def __init__(self, model: torch.nn.Module, placement: Placement):
        self._model = model
        self._placement = placement
        self._snapshot: dict[str, torch.Tensor] | None = None

    @property
    def has_snapshot(self) -> bool:
        return self._snapshot is not None

    def _state(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._model.named_parameters()
        yield from self._model.named_buffers()

    def handle(
        self, action: str, skip_tensor_list: Sequence[str] = (), drop_snapshot_after_compare: bool = False
    ) -> dict | None:
        """Run one action; returns the checksum payload for `checksum`, raises CheckFailed on failure."""
        if action == "snapshot":
            self._snapshot = {name: t.detach().clone() for name, t in self._state()}
            return None
        if action == "reset_tensors":
            with torch.no_grad():
                for name, t in self._state():
                    if not _is_skipped(name, t, skip_tensor_list):
                        t.copy_(_random_like(t))
            return None
        if action == "compare":
            self._compare(skip_tensor_list)
            if drop_snapshot_after_compare:
                self._snapshot = None
            return None
        if action == "checksum":
            checksums = {
                name: tensor_digest(t) for name, t in self._state() if not _is_skipped(name, t, skip_tensor_list)
            }
            overall = hashlib.sha256("".join(f"{k}{v}" for k, v in sorted(checksums.items())).encode()).hexdigest()
            p = self._placement
            info = dict(tp_rank=p.tp_rank, tp_size=p.tp_size, dp_rank=p.dp_rank, dp_size=p.dp_size)
            info.update(pp_rank=0, pp_size=1, rank=p.tp_rank, size=p.tp_size)
            return {"checksums": checksums, "per_gpu_checksum": overall, "parallelism_info": info}
        raise CheckFailed(f"Unsupported action={action!r}")

    def _compare(self, skip_tensor_list: Sequence[str]) -> None:
        if self._snapshot is None:
            raise CheckFailed("no snapshot to compare against: call weights_checker action=snapshot first")
        errors = []
        current = dict(self._state())
        if set(current) != set(self._snapshot):
            raise CheckFailed(f"tensor names changed since the snapshot: {sorted(set(current) ^ set(self._snapshot))}")
        for name, actual in current.items():
            if _is_skipped(name, actual, skip_tensor_list):
                continue
            expect = self._snapshot[name]
            if expect.shape != actual.shape or expect.dtype != actual.dtype:
                errors.append(f"name={name} shape/dtype {tuple(expect.shape)}/{expect.dtype} -> {tuple(actual.shape)}")
                continue
            differ = _bytes_of(expect) != _bytes_of(actual)
            if bool(differ.any()):
                diff = (actual.float() - expect.float()).abs()
                errors.append(
                    f"name={name} max_abs_err={diff.max().item()} mean_abs_err={diff.mean().item()} "
                    f"mismatched_bytes={int(differ.sum())}"
                )
        if errors:
            raise CheckFailed("check tensor equality failed:\n" + "\n".join(errors))

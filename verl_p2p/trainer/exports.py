"""One source interface, two exports: what the trainer source needs of a trainer's HF weight stream.

The source session (lifecycle, plans, replicas, writer, checks) is the same for every trainer; only the export
differs:

- Megatron (`export.StageExporter`, modes 'pp_local' / 'filter_full'): each pipeline stage yields its own HF
  tensors; the stage's ranks run its TP/EP gathers together, and (PP > 1) each stage writes its share of every
  target (`push.StageShare`).
- FSDP / FSDP2 (`fsdp_export.FullStreamExport`, mode 'full_stream'): verl's `get_per_tensor_param()` yields
  every full tensor on every rank in step; every rank is a sender of the whole model and writes its
  byte-balanced part of every target (`planning.fsdp.build_full_stream_plan`).

Both are iterated to the end by every rank of their export group (`senders.drive_export`); `export_group_of`
names that group.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

HFTensor = tuple[str, torch.Tensor]


@runtime_checkable
class SourceExport(Protocol):
    """An export the trainer source drives once per sync."""

    mode: str  # 'pp_local' | 'filter_full' (Megatron) | 'full_stream' (FSDP)

    def export(self, *, cpu: bool = False) -> Iterator[HFTensor]: ...


def export_group_of(export: Any, stage_ranks: Sequence[int]) -> tuple[int, ...] | None:
    """The ranks whose collectives `export` runs: the PP stage for the PP-local export, every rank (None)
    otherwise (the filtered full export crosses stages; FSDP's gathers span the whole mesh)."""
    return tuple(stage_ranks) if getattr(export, "mode", None) == "pp_local" else None


def stream_digest(export: Any, error: BaseException | None = None) -> tuple[str | None, BaseException | None]:
    """(the export's stream digest for the go/no-go's agreement check, or None when it has none: Megatron's
    stages stream different tensors by design; the error to report). A failure to predict the stream joins
    `error` rather than raising: the go/no-go must still be reached by every rank."""
    digest = getattr(export, "manifest_digest", None)
    if digest is None:
        return None, error
    try:
        return digest(), error
    except Exception as exc:  # reported by the go/no-go on every rank
        return None, error or exc


def check_stream(export: Any, groups: Sequence[Any], allowed_unused: Sequence[str]) -> None:
    """The export's own pre-launch check of its stream against the push's groups, where it has one (FSDP)."""
    check = getattr(export, "check_stream", None)
    if check is not None:
        check(groups, allowed_unused)

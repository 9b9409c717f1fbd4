"""The data of a write plan: which HF tensors feed each rollout parameter and how SGLang's loader writes it.

Kept apart from the capture (`plan.py`) so the checks (`plan_checks.py`) and the plan cache read plans without
importing the capture's dispatch machinery.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

HFSpecs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class SourceView:
    """A strided view of one (contiguous) HF tensor, in its elements.

    `dtype` is set when the loader read the tensor's bits through a view of another dtype
    (`w.view(torch.float16)` on a bfloat16 tensor): the copy then reinterprets bits, it does not convert
    values, and offset/shape/stride count elements of that view dtype.
    """

    hf_name: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class RecordedWrite:
    """One write SGLang's loader made into a parameter's storage (geometry in the parameter's elements)."""

    op: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    source: SourceView | None = None
    fill_value: float | int | bool | None = None
    feeds: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def replayable(self) -> bool:
        """A copy from a view of one HF tensor, or a constant fill: replayable on any byte range."""
        return (self.op == "copy" and self.source is not None) or self.op == "fill"


@dataclass(frozen=True)
class ParamPlan:
    """What one SGLang parameter of this rank needs and how SGLang writes it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    feeds: tuple[str, ...]
    writes: tuple[RecordedWrite, ...] = ()

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize

    @property
    def replayable(self) -> bool:
        return all(w.replayable for w in self.writes)


@dataclass(frozen=True)
class WritePlan:
    """Every parameter of one rank (SGLang `named_parameters()` order) and the HF tensors it was planned from."""

    params: dict[str, ParamPlan]
    hf_specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    # non-parameter tensors SGLang computes from the checkpoint (a p2p write would leave them stale)
    derived: tuple[str, ...] = ()
    # parameters SGLang fills itself and no checkpoint tensor feeds (`rollout_local_params`): not in `params`,
    # never written, the same before and after every sync
    local: tuple[str, ...] = ()

    @property
    def used_hf_names(self) -> set[str]:
        return {n for p in self.params.values() for n in p.feeds}

    @property
    def unused_hf_names(self) -> list[str]:
        """HF tensors no parameter of this rank needs (e.g. other EP ranks' experts), checkpoint order."""
        used = self.used_hf_names
        return [n for n in self.hf_specs if n not in used]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params.values())

"""The checks of a captured write plan: every parameter byte written exactly once, every HF tensor used by some
rank, and no tensor SGLang derives after loading that a session end would not rebuild from what p2p writes.

Kept apart from the capture (`plan.py`): these read a finished plan and never touch SGLang or the dispatch mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from verl_p2p.errors import UnsupportedLayoutError
from verl_p2p.replica.derived import DERIVATIONS, known_not_rebuilt, unexplained
from verl_p2p.replica.plan_types import RecordedWrite, WritePlan


class WritePlanError(UnsupportedLayoutError):
    """SGLang's loader for this rank does something the replica cannot reproduce exactly."""


def check_syncable(plan: WritePlan) -> None:
    """Refuse a model whose rollout derives tensors from the checkpoint that no allow-listed derivation
    rebuilds from the parameters p2p writes (`derived.DERIVATIONS`; those need a rollout with sessions)."""
    problems = unexplained(dict.fromkeys(plan.derived, frozenset()), {n: p.feeds for n, p in plan.params.items()})
    if problems:
        names = list(problems)
        known = known_not_rebuilt(names)
        evidence = "".join(f"; known not rebuilt: {what} ({len(n)} tensors, e.g. {n[:2]})" for what, n in known.items())
        raise WritePlanError(
            f"SGLang computes {len(names)} non-parameter tensors of this model from its checkpoint after "
            f"loading (e.g. {names[:3]}, built by the model's post_load_weights or a weight loader) that p2p does "
            "not know to be rebuilt from the parameters it writes (allow-listed: "
            f"{[d.what for d in DERIVATIONS]}){evidence}; a rollout registers only its parameters for remote "
            "writes, so a p2p sync would leave them stale. Use a model without such post-load processing, or a "
            "backend that calls SGLang's update_weights"
        )


def _intervals(w: RecordedWrite) -> torch.Tensor:
    """[start, end) element intervals a write covers, as an (n, 2) int64 tensor."""
    dims = sorted(((s, st) for s, st in zip(w.shape, w.stride, strict=True) if s != 1), key=lambda d: -d[1])
    if any(st == 0 for _, st in dims):
        raise WritePlanError(f"a {w.op} write with a zero stride writes the same element twice")
    block = 1
    while dims and dims[-1][1] == block:
        block *= dims.pop()[0]
    starts = torch.tensor([w.offset], dtype=torch.int64)
    for size, stride in dims:
        starts = (starts[:, None] + torch.arange(size, dtype=torch.int64)[None, :] * stride).reshape(-1)
    return torch.stack([starts, starts + block], dim=1)


def validate_write_plan(plan: WritePlan) -> None:
    """Every parameter element overwritten (copy or fill) exactly once.

    Other in-place ops (a scale, an indexed put) may follow; their extent cannot be traced on meta, so
    they do not count as coverage and only make the parameter non-replayable by byte range.
    """
    problems = []
    for p in plan.params.values():
        overwrites = [w for w in p.writes if w.op in ("copy", "fill")]
        others = sorted({w.op for w in p.writes if w.op not in ("copy", "fill")})
        hint = f" (also written by {others}, whose extent cannot be traced)" if others else ""
        if not overwrites:
            problems.append(f"{p.name}: no checkpoint tensor overwrites it{hint}; the rollout keeps other values")
            continue
        iv = torch.cat([_intervals(w) for w in overwrites])
        iv = iv[torch.argsort(iv[:, 0])]
        if int(iv[0, 0]) < 0 or int(iv[:, 1].max()) > p.numel:
            problems.append(f"{p.name}: a write falls outside the parameter")
        elif bool((iv[1:, 0] < iv[:-1, 1]).any()):
            problems.append(f"{p.name}: some elements are written twice")
        elif int((iv[:, 1] - iv[:, 0]).sum()) != p.numel:
            missing = p.numel - int((iv[:, 1] - iv[:, 0]).sum())
            problems.append(f"{p.name}: {missing} of {p.numel} elements are never written{hint}")
    if problems:
        raise WritePlanError("write plan check failed: " + "; ".join(problems))


def check_hf_coverage(plans: Sequence[WritePlan], hf_names: Iterable[str] | None = None) -> None:
    """Every HF tensor lands on some rank; otherwise SGLang ignores it (a name mismatch loses an update)."""
    plans = list(plans)
    names = list(hf_names) if hf_names is not None else list(plans[0].hf_specs) if plans else []
    used = set().union(*(p.used_hf_names for p in plans)) if plans else set()
    lost = [n for n in names if n not in used]
    if lost:
        raise WritePlanError(
            f"{len(lost)} HF tensors reach no rollout rank's parameters, e.g. {lost[:5]}: SGLang's loader skips "
            "them (check the exported names, e.g. per-expert names for MoE, and the rollout's model class)"
        )

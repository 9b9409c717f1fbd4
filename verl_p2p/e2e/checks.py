"""The e2e harness's check record, the expectations checks compare with, and the judgements that need more than
one comparison.

A check is what the report's `passed` is made of: a drill's note that a reader must interpret is not a check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


def killed_mid_push_check(
    marker_exists: bool, old: Mapping[str, str], new: Mapping[str, str], held: Mapping[str, str] | None
) -> Check:
    """Whether the kill drill's trainer died in the middle of its push (review finding 10).

    `old` / `new`: the checksums a rollout holding the previous / the pushed weight set answers; `held`: what the
    rollout answers after the kill (None: it could not be read). Mid-push means the trainer reached its stall
    marker, wrote some new bytes (a tensor that differs between the sets no longer holds the old ones) and not all
    of them (some such tensor does not hold the new ones yet). A push that finished before the kill, or a trainer
    that died before writing, fails this check even though the sync fails as the drill expects.
    """
    differing = sorted(k for k in new if old.get(k) != new[k])
    if not marker_exists:
        return Check("killed_mid_push", False, "the trainer never reached its stall marker (killed before the push)")
    if held is None:
        return Check("killed_mid_push", False, "the rollout's checksums could not be read after the kill")
    if not differing:
        return Check("killed_mid_push", False, "the weight sets do not differ: written bytes cannot be told apart")
    changed = [k for k in differing if held.get(k) != old[k]]
    complete = [k for k in differing if held.get(k) == new[k]]
    detail = f"{len(changed)} of {len(differing)} differing tensors changed, {len(complete)} hold the new bytes"
    if not changed:
        return Check("killed_mid_push", False, detail + ": nothing was written before the kill")
    if len(complete) == len(differing):
        return Check("killed_mid_push", False, detail + ": the push had finished before the kill")
    return Check("killed_mid_push", True, detail)


@dataclass
class Expectation:
    checksums: dict[str, str]
    generation: list[int] | None  # PROMPT, the first generation after a flush (a fresh prefill)
    side_generation: list[int] | None = None  # SIDE_PROMPT, likewise


class IndistinctWeightSetsError(RuntimeError):
    """Both weight sets generate the same tokens: the generation check could not catch stale weights."""


def require_distinct_generations(arch: str, expect: dict[int, Expectation]) -> None:
    """Refuse a run whose generation check would pass with the old weights still served: for classes whose
    derived tensors (MLA's w_kc / w_vc) no checksum covers, the generations are the only proof of the rebuild."""
    a, b = expect[0], expect[1]
    if a.generation is None or b.generation is None:
        return  # a rollout without generation (the loopback stand-in): checksums only
    if (a.generation, a.side_generation) == (b.generation, b.side_generation):
        raise IndistinctWeightSetsError(
            f"{arch}: both weight sets generate {a.generation} (and {a.side_generation} for the side prompt), so "
            "equal generations would not show that a sync took effect; use a model whose layers shape the "
            "output (write_tiny_checkpoint(init='model')) or another --seed"
        )

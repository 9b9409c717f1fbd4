"""Published rollout parameters that no sync writes: refused before the first write unless the user lists them.

A rollout rank publishes every parameter it registered with its transfer engine; the write plan of that rank
(the replica's, built from the checkpoint the rollout loaded) says which of them p2p writes. One it does not
write keeps the value loaded at start-up while the rest of the model trains on: the rollout would generate
from a mix of old and new weights and every sync would report success. With PP > 1 each stage writes a share
of the plan, but the plan itself covers the whole rank, so the check is the same on every stage.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence

from verl_p2p.errors import RemoteMismatchError

OPTION = "engine_kwargs.<backend>.unwritten_params_allowed"
SHOWN = 12


def unwritten(published: Iterable[str], planned: Iterable[str], allowed: Sequence[str] = ()) -> list[str]:
    """Published parameter names the plan does not write and no `allowed` fnmatch pattern matches, sorted."""
    planned = set(planned)
    return sorted(
        name
        for name in published
        if name not in planned and not any(fnmatch.fnmatchcase(name, pattern) for pattern in allowed)
    )


def check_coverage(targets: Mapping[str, tuple[Iterable[str], Iterable[str]]], allowed: Sequence[str] = ()) -> None:
    """`targets`: {where: (published names, planned names)}. Raise RemoteMismatchError naming, per target, the
    published parameters no sync writes (and the fix); nothing is written when it raises."""
    problems = []
    for where, (published, planned) in targets.items():
        left = unwritten(published, planned, allowed)
        if left:
            more = f" ... and {len(left) - SHOWN} more" if len(left) > SHOWN else ""
            problems.append(f"{where}: {len(left)} published param(s) no sync writes: {left[:SHOWN]}{more}")
    if problems:
        raise RemoteMismatchError(
            "the rollout publishes weights that p2p would never write (they would keep their start-up values "
            "while the rest of the model trains); nothing was written:\n  " + "\n  ".join(problems) + "\n"
            "Fix: make the rollout's model and the trainer's checkpoint agree (same architecture and config, so "
            "the write plan covers every parameter), or, if these parameters are meant to stay as loaded "
            f"(frozen), list them (names or fnmatch patterns) in {OPTION}"
        )

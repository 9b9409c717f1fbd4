"""Why verl's own `nixl` checkpoint engine cannot run the one-H200 GRPO comparison (issue 19's side-by-side run).

On the H200 (docs/measurements/grpo_h200_one_step_off_qwen3_4b_nixl.json) verl 0.9.1's nixl engine started, every
worker answered `prepare`, and the first `update_weights` stopped in verl's `build_process_group` with
"rollout_kwargs[next_agent_metadata] must have length of 1". The cause is verl's ring topology: its last slice,
`metadata[-rollout_world_size + 1:]`, is `metadata[0:]` when the rollout has one rank. These tests run that very
`build_topology` (read from the installed verl's source: its module imports cupy and NIXL, which CI does not
install) and pin the defect, so a verl that fixes it fails here and the nixl run can be tried again.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest


def _verl_build_topology():
    """verl's `NIXLCheckpointEngine.build_topology`, compiled from the installed source alone (it uses no names of
    its module)."""
    spec = importlib.util.find_spec("verl.checkpoint_engine")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("verl is not installed: `make setup` installs it")
    path = Path(next(iter(spec.submodule_search_locations))) / "nixl_checkpoint_engine.py"
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "NIXLCheckpointEngine":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "build_topology":
                    item.decorator_list = []  # the classmethod: called with cls=None below
                    module = ast.Module(body=[item], type_ignores=[])
                    scope: dict = {}
                    exec(compile(module, str(path), "exec"), scope)
                    return scope["build_topology"]
    pytest.fail(f"{path} has no NIXLCheckpointEngine.build_topology: verl changed; re-read its nixl engine")


def _lengths_verl_asserts(actor_ranks: int, rollout_ranks: int) -> dict[str, tuple[int, int]]:
    """Each rollout kwarg's length next to the length verl's build_process_group asserts (its rollout world size)."""
    build = _verl_build_topology()
    metadata = [f"trainer {i}" for i in range(actor_ranks)] + [f"rollout {i}" for i in range(rollout_ranks)]
    _, rollout_kwargs = build(None, actor_ranks, rollout_ranks, metadata)
    return {k: (len(v), rollout_ranks) for k, v in rollout_kwargs.items()}


def test_verl_nixl_ring_breaks_with_one_rollout_rank():
    lengths = _lengths_verl_asserts(actor_ranks=1, rollout_ranks=1)
    # the H200 run's failure, exactly: one entry per rank expected, the whole metadata list plus None given
    assert lengths["next_agent_metadata"] == (3, 1)
    assert all(got == want for k, (got, want) in lengths.items() if k != "next_agent_metadata")


@pytest.mark.parametrize("rollout_ranks", [2, 4])
def test_verl_nixl_ring_holds_with_several_rollout_ranks(rollout_ranks):
    lengths = _lengths_verl_asserts(actor_ranks=2, rollout_ranks=rollout_ranks)
    assert all(got == want for got, want in lengths.values()), lengths

"""Transfer plan properties over many shapes: one sender per target per stage, parallel first, reuse next."""

import itertools
import random

import pytest

from verl_p2p.planning.plan import SourceRank, build_transfer_plan
from verl_p2p.planning.targets import TargetRank


def _targets(ranks_per_engine):
    return [TargetRank(e, r) for e, n in enumerate(ranks_per_engine) for r in range(n)]


def _sources(n_per_stage, pp):
    return [SourceRank(global_rank=s * n_per_stage + i, pp_stage=s) for s in range(pp) for i in range(n_per_stage)]


SHAPES = [
    (n_src, pp, engines)
    for n_src, pp, engines in itertools.product(
        [1, 2, 3, 4, 8], [1, 2, 3], [(1,), (2, 2), (4, 4, 4), (2, 4), (8,), (1, 2, 4, 8), (2, 2, 2, 2, 2)]
    )
]


@pytest.mark.parametrize("n_src,pp,engines", SHAPES)
def test_every_target_exactly_one_sender_per_stage(n_src, pp, engines):
    sources, targets = _sources(n_src, pp), _targets(engines)
    plan = build_transfer_plan(sources, targets)
    for stage in range(pp):
        stage_ranks = [s.global_rank for s in sources if s.pp_stage == stage]
        assigned = [t for r in stage_ranks for t in plan.targets_of(r)]
        assert sorted(assigned) == sorted(targets), "each target exactly once per stage"
        busy = [r for r in stage_ranks if plan.targets_of(r)]
        assert len(busy) == min(len(stage_ranks), len(targets)), "all senders used when there is work"
        loads = [len(plan.targets_of(r)) for r in stage_ranks]
        if len(targets) >= len(stage_ranks):
            assert min(loads) >= 1


@pytest.mark.parametrize("n_src,pp,engines", SHAPES)
def test_deterministic_and_order_independent(n_src, pp, engines):
    sources, targets = _sources(n_src, pp), _targets(engines)
    plan = build_transfer_plan(sources, targets)
    shuffled_s, shuffled_t = sources[:], targets[:]
    random.Random(7).shuffle(shuffled_s)
    random.Random(8).shuffle(shuffled_t)
    assert build_transfer_plan(shuffled_s, shuffled_t).tasks == plan.tasks


def test_same_rank_reuse_after_parallel_first():
    # 2 sources, 2 engines x 2 ranks: each source gets one rank index and writes it to both engines.
    plan = build_transfer_plan(_sources(2, 1), _targets((2, 2)))
    assert plan.targets_of(0) == (TargetRank(0, 0), TargetRank(1, 0))
    assert plan.targets_of(1) == (TargetRank(0, 1), TargetRank(1, 1))


def test_layout_keys_prevent_reuse_across_different_layouts():
    targets = _targets((2, 2))
    keys = {t: (t.engine, t.rank) for t in targets}  # every target holds distinct bytes
    plan = build_transfer_plan(_sources(2, 1), targets, layout_keys=keys)
    counts = sorted(len(plan.targets_of(r)) for r in (0, 1))
    assert counts == [2, 2]
    assert sum(len(plan.targets_of(r)) for r in (0, 1)) == 4


def test_more_sources_than_targets_leaves_idle_sources():
    plan = build_transfer_plan(_sources(8, 1), _targets((2,)))
    assert plan.senders() == [0, 1]
    assert all(plan.targets_of(r) == () for r in range(2, 8))
    assert "idle" in plan.describe()


def test_sender_of_and_errors():
    plan = build_transfer_plan(_sources(2, 2), _targets((2,)))
    assert plan.sender_of(TargetRank(0, 1), 1) == 3
    with pytest.raises(KeyError):
        plan.sender_of(TargetRank(5, 0), 0)
    with pytest.raises(ValueError, match="duplicate rollout targets"):
        build_transfer_plan(_sources(1, 1), [TargetRank(0, 0), TargetRank(0, 0)])
    with pytest.raises(ValueError, match="no trainer source"):
        build_transfer_plan([], _targets((1,)))

"""Transfer plan properties over many shapes: one sender per target per stage, parallel first, reuse next; with
more sources than targets in a stage, every target split over several sources, disjoint parts balanced by bytes."""

import itertools
import random

import pytest

from verl_p2p.planning.plan import SourceRank, build_transfer_plan, split_by_bytes
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
    plan = build_transfer_plan(sources, targets, split=False)
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
    again = build_transfer_plan(shuffled_s, shuffled_t)
    assert again.tasks == plan.tasks and again.parts == plan.parts


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


def test_more_sources_than_targets_leaves_idle_sources_without_the_split():
    plan = build_transfer_plan(_sources(8, 1), _targets((2,)), split=False)
    assert plan.senders() == [0, 1]
    assert all(plan.targets_of(r) == () for r in range(2, 8))
    assert "idle" in plan.describe()


@pytest.mark.parametrize("n_src,pp,engines", SHAPES)
def test_the_split_covers_every_target_once_per_stage_in_equal_part_counts(n_src, pp, engines):
    sources, targets = _sources(n_src, pp), _targets(engines)
    plan = build_transfer_plan(sources, targets)
    for stage in range(pp):
        ranks = [s.global_rank for s in sources if s.pp_stage == stage]
        count = max(1, len(ranks) // len(targets))
        for t in targets:
            writers = [r for r in ranks if t in plan.targets_of(r)]
            parts = sorted(plan.part_of(r, t) for r in writers)
            assert parts == [(i, count) for i in range(count)], f"{t}: parts {parts}"  # each part once
        busy = [r for r in ranks if plan.targets_of(r)]
        assert len(busy) == (count * len(targets) if count > 1 else min(len(ranks), len(targets)))
        if count > 1:
            assert all(len(plan.targets_of(r)) == 1 for r in busy)  # one target per NIC


def test_eight_sources_two_targets_four_parts_each_and_the_unknown_of_a_failed_source():
    plan = build_transfer_plan(_sources(8, 1), _targets((2,)))
    assert plan.senders() == list(range(8))
    assert plan.sources_of(TargetRank(0, 0)) == [0, 2, 4, 6] and plan.sources_of(TargetRank(0, 1)) == [1, 3, 5, 7]
    assert [plan.part_of(r, TargetRank(0, r % 2)) for r in range(8)] == [(i // 2, 4) for i in range(8)]
    assert "e0r1 part 4/4" in plan.describe()
    assert plan.left_unknown([5]) == [TargetRank(0, 1)]  # only the failed source's target is re-pushed
    assert plan.left_unknown([0, 3]) == [TargetRank(0, 0), TargetRank(0, 1)] and plan.left_unknown([]) == []


def test_split_by_bytes_is_disjoint_complete_balanced_and_deterministic():
    rng = random.Random(3)
    sizes = [(f"p{i}", rng.choice([1, 7, 64, 4096, 1 << 20])) for i in range(300)]
    for count in (1, 2, 3, 5):
        parts = split_by_bytes(sizes, count)
        assert len(parts) == count and set().union(*parts) == {n for n, _ in sizes}
        assert sum(len(p) for p in parts) == len(sizes)  # disjoint: no parameter written twice
        loads = [sum(b for n, b in sizes if n in p) for p in parts]
        assert max(loads) - min(loads) <= max(b for _, b in sizes)  # LPT: within one parameter
        shuffled = sizes[:]
        rng.shuffle(shuffled)
        assert split_by_bytes(shuffled, count) == parts
    with pytest.raises(ValueError, match="0 parts"):
        split_by_bytes(sizes, 0)


def test_sender_of_and_errors():
    plan = build_transfer_plan(_sources(2, 2), _targets((2,)))
    assert plan.sender_of(TargetRank(0, 1), 1) == 3
    with pytest.raises(KeyError):
        plan.sender_of(TargetRank(5, 0), 0)
    with pytest.raises(ValueError, match="duplicate rollout targets"):
        build_transfer_plan(_sources(1, 1), [TargetRank(0, 0), TargetRank(0, 0)])
    with pytest.raises(ValueError, match="no trainer source"):
        build_transfer_plan([], _targets((1,)))


def test_assign_hands_each_trainer_rank_its_part():
    from verl_p2p.backend.topology import SourceMeta, assign, layouts_of
    from verl_p2p.planning.targets import RemoteRankInfo

    server_info = {"tp_size": 2, "ep_size": 1}
    layouts = layouts_of(0, server_info, [0, 1])
    infos = {t: RemoteRankInfo(f"127.0.0.1:{1000 + t.rank}", {}) for t in layouts}
    out = assign([SourceMeta(r, 0) for r in range(6)], {0: server_info}, infos, layouts, generation=3)
    assert [out[r].targets for r in range(6)] == [(TargetRank(0, r % 2),) for r in range(6)]
    assert [out[r].parts for r in range(6)] == [{TargetRank(0, r % 2): (r // 2, 3)} for r in range(6)]
    assert all(out[r].stage_senders == tuple(range(6)) for r in range(6))  # every rank sends
    whole = assign([SourceMeta(0, 0)], {0: server_info}, infos, layouts, generation=4)[0]
    assert whole.parts == {} and whole.targets == (TargetRank(0, 0), TargetRank(0, 1))

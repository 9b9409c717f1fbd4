"""A re-push plans only what can run (R29): `assign(..., unreachable=...)` cuts off every rank that exports with a
dead or late rank, and refuses a stage left with no rank that can export, naming the ranks and every paused target."""

from __future__ import annotations

import pytest

from verl_p2p.backend.topology import SourceMeta, assign
from verl_p2p.errors import P2PError
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo, TargetRank

ARGS = {"tp_size": 1, "dtype": "float32"}


def _plan(sources, engines=4, **kwargs):
    targets = [TargetRank(e, 0) for e in range(engines)]
    infos = {t: RemoteRankInfo(f"127.0.0.1:{1000 + t.engine}", {"w": RemoteParam(4096, 4, 4)}) for t in targets}
    layouts = {t: layout_from_server_args(ARGS, 0) for t in targets}
    return assign(sources, dict.fromkeys(range(engines), ARGS), infos, layouts, 2, **kwargs)


def test_pp2_with_dp_copies_cuts_off_only_the_dead_ranks_tp_pair_in_its_stage():
    # PP2 x TP2 x DP2: stage 0 = ranks 0-3 (TP pairs {0,1} {2,3}), stage 1 = ranks 4-7 (TP pairs {4,5} {6,7})
    peers = {r: (r - r % 2, r - r % 2 + 1) for r in range(8)}
    sources = [SourceMeta(r, r // 4, 2, export_peers=peers[r]) for r in range(8)]
    plan = _plan(sources, unreachable=[2])
    for r in (2, 3):
        assert not plan[r].export and plan[r].targets == () and plan[r].stage_ranks == (r,)
    for r in (0, 1):
        assert plan[r].export and plan[r].stage_ranks == (0, 1)
    for r in (4, 5, 6, 7):  # the other stage is untouched
        assert plan[r].export and plan[r].stage_ranks == (4, 5, 6, 7)
    by_stage = {s: {t for r, a in plan.items() if a.pp_stage == s for t in a.targets} for s in (0, 1)}
    assert by_stage[0] == by_stage[1] == {TargetRank(e, 0) for e in range(4)}  # every target by both stages


def test_fsdp_ranks_are_refused_naming_the_rank_and_every_paused_target():
    sources = [SourceMeta(r, 0, full_stream=True) for r in range(2)]  # export_peers None: every rank
    with pytest.raises(P2PError) as info:
        _plan(sources, engines=2, unreachable=[1])
    text = str(info.value)
    assert "without trainer rank(s) [1]" in text and "ranks [0] run with them" in text, text
    assert str(TargetRank(0, 0)) in text and str(TargetRank(1, 0)) in text and "restart the trainer rank" in text


def test_tp_peers_without_a_dp_copy_are_refused():
    sources = [SourceMeta(r, 0, export_peers=(0, 1)) for r in range(2)]
    with pytest.raises(P2PError, match=r"can export without trainer rank\(s\) \[0\]"):
        _plan(sources, unreachable=[0])


def test_without_unreachable_ranks_every_rank_exports_as_before():
    sources = [SourceMeta(r, 0, export_peers=(r - r % 2, r - r % 2 + 1)) for r in range(4)]
    plan = _plan(sources, exclude=[2])  # a rank that failed naming no target: idle, still exports
    assert all(a.export and a.stage_ranks == (0, 1, 2, 3) for a in plan.values())
    assert plan[2].targets == ()

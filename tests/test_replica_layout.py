"""Rank groups the replica's stand-in parallel state uses, and 0.5.23-style attention-DP server args."""

import pytest

from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.replica.rank_context import StandInGroup, base_version, group_ranks


def test_resolved_attn_dp_size_is_honoured():
    # SGLang >= 0.5.22 serves `--dp-size 2 --enable-dp-attention` as attn_dp_size=2, dp_size=1
    served = {"tp_size": 4, "ep_size": 2, "dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": True}
    legacy = {"tp_size": 4, "ep_size": 2, "dp_size": 2, "enable_dp_attention": True}
    for rank in range(4):
        assert layout_from_server_args(served, rank) == layout_from_server_args(legacy, rank)
    assert layout_from_server_args(served, 3).attn_dp_rank == 1


def test_group_ranks_follow_sglang_arithmetic():
    lay = layout_from_server_args({"tp_size": 4, "ep_size": 2, "dp_size": 2, "enable_dp_attention": True}, 3)
    groups = group_ranks(lay)
    assert groups["tp"] == [0, 1, 2, 3]
    assert groups["attn_tp"] == [2, 3]
    assert groups["moe_ep"] == [1, 3]  # same moe_tp rank, one per EP rank
    assert groups["moe_tp"] == [2, 3]
    g = StandInGroup("moe_ep", groups["moe_ep"], 3)
    assert (g.world_size, g.rank_in_group, g.is_first_rank, g.is_last_rank) == (2, 1, False, True)


def test_stand_in_group_refuses_communication_by_name():
    g = StandInGroup("tp", [0, 1], 0)
    with pytest.raises(AttributeError, match="stand-in.*all_reduce"):
        g.all_reduce(None)


def test_base_version():
    assert base_version("0.5.12") == base_version("0.5.12.post1") == base_version("0.5.12+cu128") == "0.5.12"


def test_groups_spanning_tp_are_the_tp_group_and_fresh_per_rank():
    from verl_p2p.replica.rank_context import stand_in_groups

    lay = layout_from_server_args({"tp_size": 2, "ep_size": 2}, 1)
    groups = stand_in_groups(lay)
    assert groups["attn_tp"] is groups["tp"] and groups["moe_ep"] is groups["tp"]
    assert groups["moe_tp"] is not groups["tp"] and groups["moe_tp"].world_size == 1
    assert groups["world"] is not groups["tp"] and groups["pp"].ranks == [1]
    again = stand_in_groups(lay)
    assert again["tp"] is not groups["tp"]

"""Rollout rank layouts from server args (docs/protocol.md section 6) and rejection of unreproducible ones."""

import pytest

from verl_p2p.errors import UnsupportedLayoutError
from verl_p2p.planning.layout import layout_from_server_args


def test_tp_ep_layout():
    args = {"tp_size": 4, "ep_size": 2, "dp_size": 1}
    layouts = [layout_from_server_args(args, r) for r in range(4)]
    assert [(lay.moe_ep_rank, lay.moe_tp_rank) for lay in layouts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(lay.moe_tp_size == 2 and lay.attn_tp_size == 4 and lay.attn_dp_size == 1 for lay in layouts)
    assert [lay.attn_tp_rank for lay in layouts] == [0, 1, 2, 3]


def test_dp_attention_layout():
    args = {"tp_size": 4, "ep_size": 4, "dp_size": 2, "enable_dp_attention": True, "enable_dp_lm_head": True}
    layouts = [layout_from_server_args(args, r) for r in range(4)]
    assert [(lay.attn_dp_rank, lay.attn_tp_rank) for lay in layouts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [lay.moe_ep_rank for lay in layouts] == [0, 1, 2, 3]
    assert all(lay.enable_dp_lm_head for lay in layouts)


@pytest.mark.parametrize(
    "args",
    [
        {"tp_size": 2, "dp_size": 2},  # 0.5.12: two copies of the model in one engine
        {"tp_size": 4, "dp_size": 2, "enable_dp_attention": False},
        {"tp_size": 4, "dp_size": 2, "attn_dp_size": 2, "enable_dp_attention": True},  # >= 0.5.22: copies of DP-attn
    ],
)
def test_dp_without_dp_attention_is_refused_naming_the_collision_and_the_fix(args):
    """Each copy's ranks register with the bootstrap server by tp_rank: they would overwrite each other."""
    with pytest.raises(UnsupportedLayoutError) as info:
        layout_from_server_args(args, 1)
    text = str(info.value)
    assert f"dp_size={args['dp_size']} " in text and "runs 2 copies of the model" in text and "same tp_rank" in text
    assert "enable_dp_attention=true" in text and "data_parallel_size=1" in text


def test_dp_attention_reported_as_attn_dp_size_is_one_copy():
    """SGLang >= 0.5.22 reports attention DP as attn_dp_size with dp_size=1."""
    lay = layout_from_server_args({"tp_size": 4, "dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": True}, 3)
    assert (lay.attn_dp_size, lay.attn_dp_rank, lay.attn_tp_rank) == (2, 1, 1)


def test_layout_keys_distinguish_layouts():
    a = layout_from_server_args({"tp_size": 2, "ep_size": 2}, 0)
    b = layout_from_server_args({"tp_size": 2, "ep_size": 1}, 0)
    assert a.key != b.key
    assert a.key == layout_from_server_args({"tp_size": 2, "ep_size": 2}, 0).key


@pytest.mark.parametrize(
    "args,needle",
    [
        ({"tp_size": 2, "pp_size": 2}, "pp_size"),
        ({"tp_size": 2, "ep_size": 2, "ep_num_redundant_experts": 2}, "ep_num_redundant_experts"),
        ({"tp_size": 2, "enable_eplb": True}, "enable_eplb"),
        ({"tp_size": 2, "init_expert_location": "/tmp/map.json"}, "init_expert_location"),
        ({"tp_size": 3, "ep_size": 2}, "divisible"),
    ],
)
def test_unreproducible_layouts_rejected(args, needle):
    with pytest.raises(UnsupportedLayoutError, match=needle):
        layout_from_server_args(args, 0)


def test_rank_out_of_range():
    with pytest.raises(UnsupportedLayoutError, match="outside tp_size"):
        layout_from_server_args({"tp_size": 2}, 2)


def test_published_layout_must_agree():
    args = {"tp_size": 4, "ep_size": 2}
    assert layout_from_server_args(args, 3, published={"tp_rank": 3, "moe_ep_rank": 1, "moe_tp_rank": 1}).tp_rank == 3
    with pytest.raises(UnsupportedLayoutError, match="moe_ep_rank"):
        layout_from_server_args(args, 3, published={"moe_ep_rank": 0})

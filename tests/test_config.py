"""P2PConfig: defaults, validation messages that list the valid keys, OmegaConf input."""

import pytest
from omegaconf import OmegaConf

from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PConfigError


def test_defaults_are_production():
    cfg = P2PConfig.from_mapping(None)
    assert (cfg.transport, cfg.protocol, cfg.pause_mode) == ("mooncake", "rdma", "abort")
    assert cfg.bucket_size_bytes == 512 << 20
    assert (cfg.executor, cfg.verify_first_push, cfg.staging) == ("compiled", True, "auto")
    assert cfg.p2p_push_retries == 1
    assert (cfg.p2p_push_deadline_s, cfg.p2p_prepare_deadline_s) == (600.0, 1200.0)


def test_the_push_deadline_must_leave_room_for_a_write_timeout():
    with pytest.raises(P2PConfigError, match=r"p2p_push_deadline_s=30 is not above p2p_transfer_timeout=60\.0"):
        P2PConfig.from_mapping({"p2p_push_deadline_s": 30})


def test_unknown_key_lists_valid_keys():
    with pytest.raises(P2PConfigError) as err:
        P2PConfig.from_mapping({"p2p_transfer_timout": 3})
    msg = str(err.value)
    assert "p2p_transfer_timout" in msg and "p2p_transfer_timeout" in msg and "valid keys" in msg


@pytest.mark.parametrize(
    "key,value",
    [
        ("transport", "ucx"),
        ("protocol", "ib"),
        ("pause_mode", "in_place"),
        ("p2p_transfer_num_workers", 0),
        ("p2p_transfer_timeout", -1),
        ("bucket_size_mb", 1.5),
        ("check_weight_update_equal", "yes"),
        ("export_mode", "fast"),
        ("executor", "triton"),
        ("verify_first_push", "yes"),
        ("staging", "hbm"),
        ("p2p_push_retries", -1),
        ("p2p_push_retries", 1.5),
        ("p2p_push_retries", True),
        ("p2p_push_deadline_s", 0),
        ("p2p_push_deadline_s", "600"),
        ("p2p_prepare_deadline_s", -5),
        ("p2p_prepare_deadline_s", True),
    ],
)
def test_bad_values_name_key_and_choices(key, value):
    with pytest.raises(P2PConfigError, match=key):
        P2PConfig.from_mapping({key: value})


def test_omegaconf_and_skip_list_forms():
    node = OmegaConf.create({"protocol": "tcp", "check_weight_update_skip_list": ["a", "b"]})
    cfg = P2PConfig.from_mapping(node)
    assert cfg.protocol == "tcp" and cfg.check_weight_update_skip_list == ("a", "b")
    assert P2PConfig.from_mapping({"check_weight_update_skip_list": "x,y"}).check_weight_update_skip_list == ("x", "y")

"""One parser and one set of cut-offs for SGLang releases (review finding 20, issue 37): a release candidate,
post release or local build of a release has what that release has, wherever the version is judged."""

from __future__ import annotations

import asyncio

import pytest

from verl_p2p.config import P2PConfig
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.checker import checker_fields
from verl_p2p.rollout.lifecycle import SyncLifecycle


@pytest.mark.parametrize("version", ["0.5.21rc0", "0.5.21.post1", "0.5.21+cu128", "0.5.23.dev4+gabc"])
def test_a_prerelease_of_the_sessions_release_is_expected_to_have_sessions(fakes, version):
    """Before the fix `Version("0.5.21rc0") < Version("0.5.21")`: such a server was planned as sessionless, so the
    begin's answer re-planned inside the pause (and post-load models were refused)."""
    (server,) = fakes(1, version=version)
    adapter = P2PReplicaAdapter(0, server.url, bootstrap_url=server.bootstrap_url)
    lifecycle = SyncLifecycle([adapter])
    asyncio.run(lifecycle.connect())
    assert adapter.sessions_expected is True and lifecycle.sessionless_engines() == ()


def test_an_older_or_unreadable_release_is_not_taken_for_one_with_sessions(fakes):
    old, garbled = fakes(2, version="0.5.20")[0], fakes(1, version="nightly")[0]
    adapters = [P2PReplicaAdapter(i, s.url, bootstrap_url=s.bootstrap_url) for i, s in enumerate([old, garbled])]
    asyncio.run(SyncLifecycle(adapters).connect())
    assert [a.sessions_expected for a in adapters] == [False, None]


def test_the_checker_sends_the_fields_a_release_candidate_accepts():
    config = P2PConfig(check_weight_update_allow_quant_error=True, check_weight_update_skip_list=("k_scale",))
    fields, dropped = checker_fields(config, "0.5.21rc0", "compare")
    assert fields == {"allow_quant_error": True, "skip_tensor_list": ["k_scale"]} and dropped == []


def test_one_parser_and_one_constant_everywhere():
    from verl_p2p.loopback.features import Features, parse_version
    from verl_p2p.replica.model_class import SESSIONS_SINCE as MESSAGE_SINCE
    from verl_p2p.sglang_versions import SESSIONS_SINCE, at_least, has_sessions, parse_release, release_text

    assert parse_release("0.5.21rc0") == parse_release("0.5.21") == (0, 5, 21) == SESSIONS_SINCE
    assert parse_release("0.6") == (0, 6, 0) and parse_release("garbage") is None and parse_release(None) is None
    assert has_sessions("0.5.21rc0") and has_sessions("0.5.20.post3") is False and has_sessions("") is None
    assert at_least("0.5.15rc1", (0, 5, 15)) is True
    assert MESSAGE_SINCE == release_text(SESSIONS_SINCE) == "0.5.21"
    assert Features.of("0.5.21rc0").weight_update_session and parse_version("0.5.21rc0") == SESSIONS_SINCE
    with pytest.raises(ValueError, match="not an SGLang version"):
        parse_version("nightly")

"""One context manager sets process environment variables around a step and restores them: the rank context
(SGLang's build-time variables) and Mooncake's engine start (its transfer timeout) both use it."""

from __future__ import annotations

import importlib
import os

from verl_p2p.environment import environment_set
from verl_p2p.transfer import mooncake

rank_context = importlib.import_module("verl_p2p.replica.rank_context")  # the package exports a function of that name

SET, UNSET = "VERL_P2P_TEST_SET", "VERL_P2P_TEST_UNSET"


def test_values_are_set_inside_and_restored_or_removed_after(monkeypatch):
    monkeypatch.setenv(SET, "before")
    monkeypatch.delenv(UNSET, raising=False)
    with environment_set({SET: "inside", UNSET: "inside"}):
        assert os.environ[SET] == os.environ[UNSET] == "inside"
    assert os.environ[SET] == "before" and UNSET not in os.environ


def test_none_unsets_a_variable_while_inside(monkeypatch):
    monkeypatch.setenv(SET, "before")
    with environment_set({SET: None}):
        assert SET not in os.environ
    assert os.environ[SET] == "before"


def test_restored_after_an_exception(monkeypatch):
    monkeypatch.delenv(UNSET, raising=False)
    try:
        with environment_set({UNSET: "x"}):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert UNSET not in os.environ


def test_both_call_sites_share_it(monkeypatch):
    assert rank_context.environment_set is environment_set
    assert mooncake.environment_set is environment_set
    monkeypatch.delenv(mooncake.TIMEOUT_ENV, raising=False)
    with mooncake.transfer_timeout_env(2.5) as seen:
        assert seen == os.environ[mooncake.TIMEOUT_ENV] == "3"
    assert mooncake.TIMEOUT_ENV not in os.environ
    monkeypatch.setenv(mooncake.TIMEOUT_ENV, "7")  # the user's value wins and is left alone
    with mooncake.transfer_timeout_env(2.5) as seen:
        assert seen == "7"
    assert os.environ[mooncake.TIMEOUT_ENV] == "7"

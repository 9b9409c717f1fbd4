"""The kill drill's check (review finding 10): the sync failing is not enough, the trainer must have died mid-push.

`killed_mid_push_check` judges the rollout's checksums after the kill against both weight sets' own checksums; the
whole drill (a real trainer process SIGKILLed, a loopback rollout) runs in tests/test_e2e_loopback.py.
"""

from __future__ import annotations

from verl_p2p.e2e.checks import killed_mid_push_check

OLD = {"a": "a0", "b": "b0", "c": "c0", "same": "s"}
NEW = {"a": "a1", "b": "b1", "c": "c1", "same": "s"}


def test_some_but_not_all_new_bytes_is_mid_push():
    partly = {"a": "a1", "b": "torn", "c": "c0", "same": "s"}
    check = killed_mid_push_check(True, OLD, NEW, partly)
    assert check.ok and check.name == "killed_mid_push"
    assert check.detail == "2 of 3 differing tensors changed, 1 hold the new bytes"
    assert killed_mid_push_check(True, OLD, NEW, {**OLD, "b": "torn"}).ok  # one torn tensor is mid-push too


def test_a_push_that_finished_before_the_kill_fails():
    check = killed_mid_push_check(True, OLD, NEW, dict(NEW))
    assert not check.ok and "finished before the kill" in check.detail


def test_a_trainer_that_died_before_writing_fails():
    check = killed_mid_push_check(True, OLD, NEW, dict(OLD))
    assert not check.ok and "nothing was written" in check.detail
    never = killed_mid_push_check(False, OLD, NEW, {**OLD, "a": "a1"})
    assert not never.ok and "stall marker" in never.detail


def test_unreadable_checksums_or_equal_sets_cannot_pass():
    assert not killed_mid_push_check(True, OLD, NEW, None).ok
    assert not killed_mid_push_check(True, OLD, dict(OLD), dict(OLD)).ok

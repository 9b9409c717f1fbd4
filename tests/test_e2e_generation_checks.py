"""The e2e harness's generation checks against a rollout that behaves as real SGLang did on the H200.

Two behaviours of SGLang 0.5.12 that the CPU loopback (which does not generate) cannot show:
- a request that arrives while the server is paused is held in its tokenizer manager (the abort of the next sync
  never reaches it) and served when generation resumes, with the weights the server holds then;
- a prompt still in the radix cache can give another greedy output than a fresh prefill of the same bytes (near-tied
  logits of random weights: the Qwen3-4B-shaped run, every checksum equal, generation "unequal" after the drills).

`GeneratingRollout` is a stand-in for those two behaviours only: its output is a function of (weights, prompt,
cached or not). The harness must compare like with like: its check's generation is the first of PROMPT after the
flush, and what drills send (a held request, a paused call) is checked against its own prompt's expectation.
"""

from __future__ import annotations

import argparse
import asyncio

import verl_p2p.e2e.run as e2e
from verl_p2p.e2e.run import Harness, SyncRecord


class GeneratingRollout:
    """Stand-in: greedy output from (weights, prompt, cached); requests wait while paused; flush empties the cache."""

    generates = True

    def __init__(self, weights: int = 0):
        self.weights, self.paused, self.cached, self.starts = weights, False, set(), 1
        self._resumed = asyncio.Event()
        self._resumed.set()

    def output(self, weights: int, prompt: list[int], cached: bool) -> list[int]:
        return [hash((weights, tuple(prompt), cached)) % 997] * 4

    async def generate(self, client, input_ids, max_new_tokens, timeout):
        await asyncio.wait_for(self._resumed.wait(), timeout)
        key = tuple(input_ids)
        out = self.output(self.weights, input_ids, key in self.cached)
        self.cached.add(key)
        return out

    async def checksums(self, client):
        return {"w": str(self.weights)}

    def alive(self) -> bool:
        return True

    def pause(self) -> None:
        self.paused = True
        self._resumed.clear()

    def sync_and_resume(self, weights: int) -> None:
        """What a sync does: new bytes, cache flushed, generation resumed."""
        self.weights, self.cached, self.paused = weights, set(), False
        self._resumed.set()


class Client:
    async def server_info(self, timeout=None):
        return {}


def harness(rollout: GeneratingRollout, tmp_path) -> Harness:
    args = argparse.Namespace(rollout="sglang", probe_timeout=0.2)
    h = Harness(args, "qwen3", 0, tmp_path)
    h.rollout, h.client = rollout, Client()
    return h


async def expectations(h: Harness) -> None:
    """As the harness builds them: a fresh server per weight set, each prompt generated first."""
    h.expect = {}
    for weights in (0, 1):
        h.rollout.sync_and_resume(weights)
        h.expect[weights] = await h._expectation(h.rollout, h.client)
    h.rollout.sync_and_resume(0)


def test_drill_prompt_shares_no_prefix_with_the_checked_prompt():
    assert e2e.SIDE_PROMPT[0] != e2e.PROMPT[0] and len(e2e.SIDE_PROMPT) == len(e2e.PROMPT)


def test_a_request_held_while_stale_is_checked_against_the_next_syncs_weights_and_leaves_the_check_exact(tmp_path):
    async def scenario():
        h = harness(GeneratingRollout(), tmp_path)
        await expectations(h)
        failed = SyncRecord(index=0, version="1", weights=1, drill="kill", outcome="failed")
        h.rollout.pause()  # the failed sync left it paused (stale)
        await h._after_failure(failed)
        assert [(c.name, c.ok) for c in failed.checks] == [
            ("server_serviceable_after_failure", True),
            ("unknown_weights_not_served", True),
        ]
        assert failed.notes["generate_after_failure"] == "not served (held)" and len(h.held_generations) == 1
        h.rollout.sync_and_resume(1)  # the recovery sync
        recovered = SyncRecord(index=1, version="2", weights=1, drill=None, outcome="ok")
        await h._held_results(recovered, 1)
        await h._verify(recovered, 1)
        return {c.name: c.ok for c in recovered.checks}, h

    checks, h = asyncio.run(scenario())
    assert checks == {
        "generation_held_while_stale_served_with_new_weights": True,
        "checksums_equal_fresh_rollout": True,
        "generation_equals_fresh_rollout": True,
    }
    assert h.held_generations == []


def test_with_the_checked_prompt_the_held_request_would_make_the_check_compare_a_cached_prompt(tmp_path, monkeypatch):
    """The defect of the H200 run, reproduced: the drill's request on PROMPT itself caches it before the check."""
    monkeypatch.setattr(e2e, "SIDE_PROMPT", e2e.PROMPT)

    async def scenario():
        h = harness(GeneratingRollout(), tmp_path)
        await expectations(h)
        h.rollout.pause()
        await h._after_failure(SyncRecord(index=0, version="1", weights=0, drill="kill", outcome="failed"))
        h.rollout.sync_and_resume(0)
        recovered = SyncRecord(index=1, version="2", weights=0, drill=None, outcome="ok")
        await h._held_results(recovered, 0)
        await h._verify(recovered, 0)
        return {c.name: c.ok for c in recovered.checks}

    checks = asyncio.run(scenario())
    assert checks["checksums_equal_fresh_rollout"] and not checks["generation_equals_fresh_rollout"]


def test_a_held_request_served_with_the_old_weights_fails_its_check(tmp_path):
    async def scenario():
        h = harness(GeneratingRollout(), tmp_path)
        await expectations(h)
        h.rollout.pause()
        await h._after_failure(SyncRecord(index=0, version="1", weights=1, drill="kill", outcome="failed"))
        h.rollout.sync_and_resume(0)  # resumed, but still holding set 0 where the sync wrote set 1
        recovered = SyncRecord(index=1, version="2", weights=1, drill=None, outcome="ok")
        await h._held_results(recovered, 1)
        return {c.name: c.ok for c in recovered.checks}

    assert asyncio.run(scenario()) == {"generation_held_while_stale_served_with_new_weights": False}


def test_a_request_lost_with_a_restarted_server_is_noted_not_failed(tmp_path):
    async def scenario():
        rollout = GeneratingRollout()
        h = harness(rollout, tmp_path)
        await expectations(h)
        rollout.pause()
        await h._after_failure(SyncRecord(index=0, version="1", weights=1, drill=None, outcome="failed"))
        task, _ = h.held_generations[0]
        task.cancel()  # the server process it went to was killed
        rollout.starts += 1
        rollout.sync_and_resume(1)
        recovered = SyncRecord(index=1, version="2", weights=1, drill=None, outcome="ok")
        await h._held_results(recovered, 1)
        return recovered

    recovered = asyncio.run(scenario())
    assert recovered.checks == [] and recovered.notes["held_generations_lost_in_restart"] == ["CancelledError"]

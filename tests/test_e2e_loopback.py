"""`verl-p2p e2e --rollout loopback`: the GPU end-to-end harness's own code path, against loopback engines.

The same command proves syncs into real SGLang servers on a GPU host (`--rollout sglang`); here it runs against the
CPU stand-in so the harness cannot rot: every sync's checksums must equal those of a rollout started fresh from the
same weights, the first sync must pass the rollout's weights_checker compare, and each failure drill must fail
naming its cause, leave the rollout serviceable, and be followed by a sync that restores exact weights.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_e2e_harness_against_loopback(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MC_LOG_LEVEL": "ERROR"}
    done = subprocess.run(
        [sys.executable, "-m", "verl_p2p.cli", "e2e", "--rollout", "loopback", "--models", "qwen3", "--syncs", "3",
         "--out", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    model = report["models"]["qwen3"]
    assert report["passed"] and model["passed"]
    syncs = model["syncs"]
    assert syncs[0]["checks"][0] == {"name": "weights_checker_compare", "ok": True, "detail": ""}
    assert model["tensors_differing_between_sets"] > 0  # the two weight sets differ, so equal checksums mean something
    assert model["one_server_at_a_time"] is False and model["rollout_started_s"] < model["fresh_stopped_s"]
    plain = [s for s in syncs if s["drill"] is None]
    assert len(plain) == 3 + 1 + 3 and all(s["outcome"] == "ok" for s in plain)  # 1: the raw-replay sync
    for s in plain:  # the pause holds no connect or prepare (plan, apply, first-push check), first sync included
        assert s["notes"]["steps_in_pause"][0] == "abort" and "push" in s["notes"]["steps_in_pause"]
        assert not {"connect", "prepare"} & set(s["notes"]["steps_in_pause"]), s["notes"]["steps_in_pause"]
        assert {"connect", "prepare", "paused"} <= set(s["phases"])
    figures = model["figures"]
    assert figures["first_sync_paused_s"] > 0 and figures["first_after_trainer_restart_paused_s"] > 0
    assert len(figures["steady_state_paused_s"]) >= 2 and figures["first_over_steady"] > 0
    (pair,) = figures["push_vs_raw"]  # the push beside raw Mooncake writes of its own write lists
    assert pair["raw_seconds"] > 0 and pair["push_over_raw"] == pytest.approx(pair["seconds"] / pair["raw_seconds"])
    for s in plain:
        assert {c["name"]: c["ok"] for c in s["checks"]} | {"weights_checker_compare": True} == {
            "weights_checker_compare": True,
            "checksums_equal_fresh_rollout": True,
            "no_stand_in_violations": True,
        }
    drills = model["drills"]
    assert drills["kill"]["outcome"] == "failed" and "trainer process exited" in drills["kill"]["error"]
    assert drills["kill"]["notes"]["killed_mid_push"] is True
    assert drills["kill"]["checks"]["killed_mid_push"] is True  # some, not all, new bytes in the rollout
    (killed,) = [c for s in syncs if s["drill"] == "kill" for c in s["checks"] if c["name"] == "killed_mid_push"]
    changed, differing, complete = map(int, re.findall(r"\d+", killed["detail"]))
    assert 0 < changed <= differing and complete < differing, killed
    assert drills["wrong_session"]["outcome"] == "failed" and "127.0.0.1:1" in drills["wrong_session"]["error"]
    assert drills["paused_call"]["outcome"] == "ok"
    assert drills["paused_call"]["checks"]["control_calls_answered_while_paused"] is True
    for name in ("kill", "wrong_session"):  # unknown bytes: the replica is named stale and stays paused
        assert drills[name]["notes"]["stale_engines"] == [0]
        assert drills[name]["checks"]["unknown_weights_not_served"] is True
    for drill in drills.values():
        assert drill["checks"]["no_stand_in_violations"] is True
        assert drill["recovery_sync"]["outcome"] == "ok"
        recovered = drill["recovery_sync"]["checks"]
        assert recovered == {"checksums_equal_fresh_rollout": True, "no_stand_in_violations": True}


@pytest.mark.slow
def test_one_server_at_a_time_starts_the_rollout_under_test_after_the_fresh_one_stopped(tmp_path):
    """`--one-server-at-a-time` (a model two servers cannot share the GPU with): the fresh rollout answers and stops
    before the rollout under test starts, and every check still compares against it."""
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MC_LOG_LEVEL": "ERROR"}
    done = subprocess.run(
        [sys.executable, "-m", "verl_p2p.cli", "e2e", "--rollout", "loopback", "--models", "qwen3", "--syncs", "2",
         "--raw-syncs", "0", "--drills", "none", "--one-server-at-a-time", "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    model = json.loads(out.read_text())["models"]["qwen3"]
    assert model["passed"] and model["one_server_at_a_time"] is True
    assert model["rollout_started_s"] >= model["fresh_stopped_s"] > 0
    assert model["tensors_differing_between_sets"] > 0
    checks = [{c["name"]: c["ok"] for c in s["checks"]} for s in model["syncs"]]
    assert len(checks) == 2 and all(c["checksums_equal_fresh_rollout"] for c in checks)
    assert checks[0]["weights_checker_compare"] is True


@pytest.mark.slow
def test_e2e_harness_takes_glm45_and_refuses_deepseek_v3_into_a_rollout_without_sessions(tmp_path):
    """The harness's new models on the CPU loopback (SGLang 0.5.12 classes and control plane, no sessions): the tiny
    GLM-4.5 (dense first layer, shared expert, sigmoid routing) syncs exactly, checked against a fresh rollout; the
    tiny DeepSeek-V3 (MLA: post_load_weights derives w_kc/w_vc) is refused by the trainer before any write, naming
    the class, what it derives and the fix; the rollout stays serviceable and never serves unknown weights."""
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MC_LOG_LEVEL": "ERROR"}
    done = subprocess.run(
        [sys.executable, "-m", "verl_p2p.cli", "e2e", "--rollout", "loopback", "--models", "glm4_moe,deepseek_v3",
         "--syncs", "2", "--raw-syncs", "0", "--drills", "none", "--out", str(out), "--workdir", str(tmp_path / "w")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode != 0  # DeepSeek-V3 cannot pass here
    report = json.loads(out.read_text())
    glm, dsv3 = report["models"]["glm4_moe"], report["models"]["deepseek_v3"]
    assert glm["passed"] and len(glm["syncs"]) == 2 and all(s["outcome"] == "ok" for s in glm["syncs"])
    assert all({c["name"]: c["ok"] for c in s["checks"]}["checksums_equal_fresh_rollout"] for s in glm["syncs"])
    assert not dsv3["passed"] and dsv3["syncs"] and all(s["outcome"] == "failed" for s in dsv3["syncs"])
    error = dsv3["syncs"][0]["error"]
    assert "PostLoadWithoutSessionsError" in error and "DeepseekV3ForCausalLM.post_load_weights" in error, error
    assert "w_kc/w_vc" in error and "nothing was written" in error and "SGLang >= 0.5.21" in error, error
    checks = {c["name"]: c["ok"] for c in dsv3["syncs"][0]["checks"]}
    assert checks["server_serviceable_after_failure"] and checks["unknown_weights_not_served"], checks


def test_harness_args_are_the_e2e_options_at_their_defaults_and_refuse_an_unknown_field():
    """The soak and cost growth build their Harness through `harness_args`: an e2e option added later reaches them
    at its default (a hand-built namespace missed `--layers` and `--one-server-at-a-time` and the soak broke)."""
    from verl_p2p.e2e.run import build_parser, harness_args

    args = harness_args(syncs=5, drills=[])
    defaults = vars(build_parser().parse_args([]))
    assert vars(args) == {**defaults, "syncs": 5, "drills": []}
    assert args.layers is None and args.one_server_at_a_time is False
    with pytest.raises(TypeError, match="probe_timeout"):
        harness_args(probe_timeout=1.0)

"""The soak (`verl-p2p soak`, verl_p2p/cli/soak.py) in CI, shortened: every fault of its catalogue once against two
loopback engines (TP2/EP2 and TP1, in a child process), a normal sync after each. The full run (200 syncs, a fault
every 10th) and its resource figures are in docs/measurements/soak_loopback.json.

Also: fault injection is a facility of the stand-in only, out of reach of every production module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from verl_p2p.cli.soak import FAULTS, SoakOptions, run_soak

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = ["backend", "rollout", "trainer", "transfer", "replica", "planning", "config.py", "errors.py"]


def test_no_production_module_imports_the_loopback():
    """The loopback and its fault injection are reachable only from tests, the demo and the soak."""
    offenders = []
    for part in PRODUCTION:
        path = ROOT / "verl_p2p" / part
        for source in [path] if path.is_file() else sorted(path.rglob("*.py")):
            for node in ast.walk(ast.parse(source.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                offenders += [f"{source.relative_to(ROOT)}: {n}" for n in names if "loopback" in n or "soak" in n]
    assert offenders == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_names_every_fault_and_never_resumes_a_stale_replica():
    syncs = 2 * len(FAULTS) + 2  # a fault on every second sync but the last: each kind once
    report = run_soak(SoakOptions(syncs=syncs, fault_every=2, warmup=4, engines=((2, 2), (1, 1))))
    assert report["unexpected"] == [], report["unexpected"]
    assert sorted(report["faults_by_kind"]) == sorted(FAULTS)
    assert report["faults_injected"] == report["faults_as_predicted"] == report["faults_named_correctly"] == len(FAULTS)
    assert report["stale_replicas_resumed"] == 0 and set(report["violations"].values()) == {0}
    assert report["passed"] + report["failed"] == syncs
    outcomes = {f["kind"]: f for f in report["faults"]}
    for kind in ("transient_freeze", "transient_partial_push"):  # p2p_push_retries=1: the same sync succeeds
        fault = outcomes[kind]
        assert fault["outcome"] == "passed" and fault["retried"] == [f"engine {fault['engine']} rank {fault['rank']}"]
    for kind in ("frozen_rank", "partial_push", "killed_rank", "http_500", "slow_control_call", "flush_refused"):
        assert outcomes[kind]["outcome"] == "failed" and outcomes[kind]["stale"] == [outcomes[kind]["engine"]]
    assert report["leaks"] == [] and report["ok"], report["leaks"]  # judged after each instance's warm-up
    resources = report["resources"]
    assert resources["threads"]["final"] <= resources["threads"]["after_warmup"]
    assert resources["fds"]["final"] <= resources["fds"]["after_warmup"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_process_soak_names_every_fault_and_recovers(tmp_path):
    """`verl-p2p soak --rollout loopback`, shortened: the four faults of the real-server soak once each (trainer
    killed, wrong session, the rollout's rank processes frozen then thawed, the server restarted at the same
    ports), a recovery sync after each that holds the fresh rollout's checksums."""
    from verl_p2p.e2e.soak import FAULTS as REAL_FAULTS
    from verl_p2p.e2e.soak import RealSoakOptions, run_real_soak

    syncs = 2 * len(REAL_FAULTS) + 1
    out = tmp_path / "soak.json"
    report = run_real_soak(RealSoakOptions(rollout="loopback", syncs=syncs, fault_every=2, warmup=1, out=str(out)))
    assert report.get("error") is None and report["unexpected"] == [], report["unexpected"]
    assert report["faults_by_kind"] == dict.fromkeys(sorted(REAL_FAULTS), 1)
    assert report["faults_as_predicted"] == report["faults_named_correctly"] == len(REAL_FAULTS)
    assert report["stale_replicas_resumed"] == 0 and report["passed"] + report["failed"] == syncs
    outcomes = {f["kind"]: f for f in report["faults"]}
    assert outcomes["server_restarted"]["outcome"] == "ok" and outcomes["server_restarted"]["retried"] == [
        "engine 0 rank 0"
    ]
    assert all(outcomes[k]["outcome"] == "failed" for k in ("trainer_killed", "wrong_session", "scheduler_frozen"))
    assert set(report["slopes_after_warmup"]) == {"driver", "trainer", "server"}
    assert report["leaks"] == [] and report["ok"] and report["leak_limits"]["fds"]["per_100_syncs"] == 10.0
    assert out.exists()

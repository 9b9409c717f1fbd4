"""Soaks judge leaks (review finding 17): growth of RSS, fds or threads after the warm-up fails the soak.

The judgement (verl_p2p/e2e/leaks.py) is the one both soaks use. It is fed the samples of a real child process
that opens a file per "sync" and keeps it (a leak), and of one that closes it again (none); a step at a process
restart and a short noisy run are not leaks. `verl-p2p soak` itself (real loopback engines, Mooncake writes) exits
1 on a leak: its sampler is wrapped to add what a leaking driver would hold.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from verl_p2p.e2e.leaks import LeakLimit, LeakLimits, judge_leaks, proc_resources

CHILD = """
import sys
held = []
for line in sys.stdin:
    f = open(sys.executable, "rb")
    if line.strip() == "leak":
        held.append(f)
    else:
        f.close()
    print("ok", flush=True)
"""


def _sample_child(mode: str, syncs: int) -> list[dict]:
    """A real process that opens one file per sync, keeping it (`leak`) or closing it; sampled after each."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    samples = []
    try:
        for sync in range(1, syncs + 1):
            child.stdin.write(mode + "\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "ok"
            samples.append({"sync": sync, **proc_resources(child.pid)})
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    return samples


def test_a_process_that_keeps_an_fd_per_sync_fails_the_judgement():
    slopes, leaks = judge_leaks({"trainer": _sample_child("leak", 30)}, 5, LeakLimits())
    assert slopes["trainer"]["fds_per_100_syncs"] == pytest.approx(100.0)
    assert len(leaks) == 1 and leaks[0].startswith("trainer fds grows +100.000 per 100 syncs"), leaks
    assert "past the limit of 10.0 per 100 syncs" in leaks[0]


def test_a_process_that_closes_what_it_opens_passes():
    slopes, leaks = judge_leaks({"trainer": _sample_child("close", 30)}, 5, LeakLimits())
    assert leaks == [] and slopes["trainer"]["fds_per_100_syncs"] == 0.0


def _rows(values: list[float], key: str = "rss_mb", restart_at: int | None = None) -> list[dict]:
    rows = []
    for sync, value in enumerate(values, start=1):
        instance = int(restart_at is not None and sync >= restart_at)
        start = restart_at if instance else 0
        rows.append({"sync": sync, "instance": instance, "instance_start": start, key: value})
    return rows


def test_growing_rss_and_threads_fail_and_name_the_process_and_limit():
    rss = [500.0 + 0.5 * i for i in range(60)]  # 50 MB per 100 syncs
    threads = [10 + i // 10 for i in range(60)]  # one thread every 10 syncs
    samples = {"driver": _rows(rss), "server": _rows(threads, "threads")}
    slopes, leaks = judge_leaks(samples, 10, LeakLimits())
    assert slopes["driver"]["rss_mb_per_100_syncs"] == pytest.approx(50.0)
    assert [leak.split(" grows")[0] for leak in leaks] == ["driver rss_mb", "server threads"], leaks
    tight = LeakLimits(rss_mb=LeakLimit(60.0, 8.0))  # the option raised past the slope: not a leak
    assert judge_leaks({"driver": _rows(rss)}, 10, tight)[1] == []


def test_a_step_at_a_restart_and_a_short_noisy_run_are_not_leaks():
    stepped = [40.0] * 30 + [48.0] * 30  # an engine rejoined at sync 31 with new connections
    assert judge_leaks({"driver": _rows(stepped, "fds", restart_at=31)}, 5, LeakLimits())[1] == []
    assert judge_leaks({"driver": _rows(stepped, "fds")}, 5, LeakLimits())[1] != []  # the same step, no restart
    noisy = [600.0, 606.0, 602.0, 610.0, 608.0, 612.0]  # +12 MB over 5 syncs: a steep slope, under the floor
    slopes, leaks = judge_leaks({"driver": _rows(noisy)}, 0, LeakLimits())
    assert slopes["driver"]["rss_mb_per_100_syncs"] > 20.0 and leaks == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verl_p2p_soak_exits_1_when_its_driver_leaks(monkeypatch, tmp_path, capsys):
    import json

    import verl_p2p.e2e.loopback_soak as loopback_soak
    from verl_p2p.cli.soak import main

    real = loopback_soak._resources
    calls = [0]

    def leaking() -> dict:
        calls[0] += 1
        sample = real()
        return {**sample, "fds": sample["fds"] + 3 * calls[0]}  # three more fds held after every sync

    monkeypatch.setattr(loopback_soak, "_resources", leaking)
    out = tmp_path / "soak.json"
    status = main(["--syncs", "8", "--fault-every", "0", "--warmup", "2", "--engines", "1:1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["unexpected"] == [] and report["passed"] == 8  # every sync as predicted: only the leak fails it
    assert status == 1 and report["ok"] is False
    assert len(report["leaks"]) == 1 and report["leaks"][0].startswith("driver fds grows"), report["leaks"]
    assert "[soak] LEAK: driver fds grows" in capsys.readouterr().out
    monkeypatch.setattr(loopback_soak, "_resources", real)
    assert main(["--syncs", "8", "--fault-every", "0", "--warmup", "2", "--engines", "1:1"]) == 0

"""`verl-p2p demo` as CI runs it: a subprocess whose exit status is the verdict, plus a negative control proving
that its bit-for-bit verification can fail. Each run starts two loopback engines and a Megatron-Bridge trainer
(about a minute on a 2-core host). The first run is the default (quiet) one: no third-party warning or
traceback reaches the user, they are in the log it names; the negative control runs with `-v`, which shows
them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def run_demo(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
    command = [sys.executable, "-m", "verl_p2p.cli", "demo", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=500, env=env)
    print(done.stdout[-3000:])
    return done


def noise(text: str) -> list[str]:
    """Lines a user should not have to read past: warnings and tracebacks."""
    return [line for line in text.splitlines() if "Traceback" in line or "Warning" in line]


def step_rows(stdout: str) -> dict[int, str]:
    """step -> the table's last column ('bit-exact' or 'N MISMATCHES')."""
    rows = re.findall(r"^\s+(\d+)\s+x\d\.\d{3}\s+(?:yes|no)\s.*?\s{2,}(bit-exact|\d+ MISMATCHES)$", stdout, re.M)
    return {int(step): verdict for step, verdict in rows}


def test_demo_exits_0_with_every_step_bit_exact_and_quiet():
    done = run_demo("--steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert step_rows(done.stdout) == {0: "bit-exact", 1: "bit-exact"}
    assert "MISMATCH" not in done.stdout
    assert "[demo] OK: 2 syncs" in done.stdout and "passed the rollout's weights_checker compare" in done.stdout
    # the last line gives the syncs' own time (the table's "total s" column summed), apart from the start-up
    last = re.search(r"^\[demo\] OK: 2 syncs, (\d+\.\d\d) s syncing \((\d+\.\d) s with start-up\)", done.stdout, re.M)
    assert last, done.stdout[-500:]
    totals = re.findall(r"^\s+\d+\s+x\d\.\d{3}\s+(?:yes|no)\s+(\d+\.\d{3})\s", done.stdout, re.M)
    assert len(totals) == 2 and float(last.group(1)) == pytest.approx(sum(map(float, totals)), abs=0.01)
    assert float(last.group(1)) < float(last.group(2))
    # quiet by default: progress while starting, no third-party lines; they went to the log it names
    assert noise(done.stdout + done.stderr) == [], noise(done.stdout + done.stderr)[:5]
    assert re.search(r"^\[demo\]\s+\d+\.\d s  trainer: ready$", done.stdout, re.M)
    log = re.search(r"output \(warnings, logs, child processes\) goes to (\S+);", done.stdout)
    assert log, done.stdout[:500]
    logged = Path(log.group(1)).read_text()
    Path(log.group(1)).unlink()
    assert noise(logged) and "FP8GlobalStateManager" in logged  # the noise exists; it is in the log


def test_demo_verification_catches_one_flipped_byte_and_exits_1():
    """Negative control: one byte of engine 0 rank 0 is flipped right after step 0's sync; the demo must name
    that tensor, fail step 0, see step 1's sync rewrite it (bit-exact again), and still exit 1. Run with `-v`:
    the third-party output the quiet run hides is shown."""
    done = run_demo("--steps", "2", "--corrupt-after-step", "0", "-v")
    assert done.returncode == 1, done.stderr[-3000:]
    assert noise(done.stderr), "-v shows third-party output"
    flipped = re.search(r"negative control: flipped byte 0 of (\S+) on engine 0 rank 0 after step 0", done.stdout)
    assert flipped, done.stdout[-3000:]
    mismatches = re.findall(r"MISMATCH step (\d+): (.*)", done.stdout)
    assert mismatches == [("0", f"engine 0 rank 0: {flipped.group(1)} differs")]
    assert step_rows(done.stdout) == {0: "1 MISMATCHES", 1: "bit-exact"}
    assert "[demo] FAILED: 2 syncs" in done.stdout

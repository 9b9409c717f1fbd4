"""Every file in scripts/ runs in CI in a mode that needs no GPU, so none rots unseen.

Each script is listed in CHECKS with how: a smoke run here (small sizes, CPU), its `--help` (the whole argument
parser: every option the source declares must be in it) for scripts that need a GPU to do anything, `bash -n`
for shell scripts, or the test file that already runs it end to end. A script not listed fails
`test_every_script_has_a_ci_check`: a new script comes with its check.
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
SCRIPTS = ROOT / "scripts"

SMOKE, HELP, SHELL, COVERED = "smoke", "help", "shell", "covered"
CHECKS = {
    "bench_lifecycle.py": SMOKE,
    "measure_sync_overhead.py": SMOKE,
    "measure_plan_capture.py": SMOKE,
    "gpu_export_check.py": SMOKE,  # --device cpu: the same checks over gloo
    "gpu_mooncake_check.py": SMOKE,  # --cases host:host
    "gpu_staging_bandwidth.py": HELP,  # CUDA copies only
    "gpu_verl_replica.py": (COVERED, "test_gpu_verl_replica.py"),  # --rollout loopback, the whole flow
    "grpo_check.py": (COVERED, "test_grpo_check.py"),  # probe, fresh and summary on recorded logs
    "grpo_report.py": (COVERED, "test_grpo_report.py"),  # JSON, table and PNG from recorded runs
    "measure_verify_first_push.py": SMOKE,  # --smoke: tiny model, one repeat
    "gpu_e2e.sh": SHELL,
    "gpu_grpo_run.sh": SHELL,
    "gpu_wheels.sh": SHELL,
    "setup.sh": SHELL,
}


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "MC_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}


def run(*args: str, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env())
    assert done.returncode == 0, f"{args}: rc {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_every_script_has_a_ci_check():
    present = sorted(p.name for p in SCRIPTS.iterdir() if p.is_file())
    assert present == sorted(CHECKS), (
        f"scripts without a CI check (add one to tests/test_scripts.py): {sorted(set(present) - set(CHECKS))}; "
        f"listed but gone: {sorted(set(CHECKS) - set(present))}"
    )


@pytest.mark.parametrize("name", [n for n, how in CHECKS.items() if how == SHELL])
def test_shell_scripts_parse(name):
    done = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", [n for n, how in CHECKS.items() if how == HELP or isinstance(how, tuple)])
def test_help_shows_every_option_the_parser_declares(name):
    source = (SCRIPTS / name).read_text()
    declared = set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", source))
    assert declared, f"{name} declares no options"
    shown = set()
    for command in [[], *([sub] for sub in re.findall(r"add_parser\(\s*\"([a-z_-]+)\"", source))]:
        text = run(str(SCRIPTS / name), *command, "--help", timeout=120).stdout
        assert text.startswith("usage:"), text[:200]
        shown |= set(re.findall(r"--[a-z0-9-]+", text))
    assert not declared - shown, f"{name} --help lacks {sorted(declared - shown)}"


@pytest.mark.parametrize("name", [n for n, how in CHECKS.items() if isinstance(how, tuple)])
def test_covering_test_runs_the_script(name):
    text = (ROOT / "tests" / CHECKS[name][1]).read_text()
    assert f'"{name}"' in text or f"scripts/{name}" in text or f"import {name.removesuffix('.py')}" in text


# ---- smoke runs ------------------------------------------------------------------------------------------------


def test_bench_lifecycle_smoke(tmp_path):
    out = tmp_path / "bench.json"
    run(
        "scripts/bench_lifecycle.py",
        "--stand-in",
        "2",
        "--tp",
        "2",
        "--params",
        "20",
        "--syncs",
        "3",
        "--json",
        str(out),
    )
    result = json.loads(out.read_text())
    assert (result["replicas"], result["ranks"], result["syncs"]) == (2, 4, 3)
    assert {"control_plane", "push", "total"} <= set(result["phases_ms"])


@pytest.mark.slow  # a loopback engine process with its rank
def test_measure_sync_overhead_smoke_checks_every_syncs_call_sequence(tmp_path):
    """It failed on its own check before (its expected sequence lacked /flush_cache); --smoke judges no timing."""
    out = tmp_path / "overhead.json"
    run(
        "scripts/measure_sync_overhead.py",
        *("--engines", "1", "--tp", "1", "--syncs", "2", "--no-baseline", "--smoke", "--json", str(out)),
        timeout=500,
    )
    result = json.loads(out.read_text())
    assert result["calls_checked"] is True and (result["replicas"], result["syncs"]) == (1, 2)
    assert "flush_cache" in result["phases_ms"]


@pytest.mark.slow  # imports SGLang
def test_measure_plan_capture_smoke_on_a_one_layer_card(tmp_path):
    out = tmp_path / "plans.json"
    run(
        "scripts/measure_plan_capture.py",
        *("--cards", "qwen3-30b-a3b", "--layouts", "tp4_ep4", "--ranks", "0", "--layers", "1", "--out", str(out)),
        timeout=400,
    )
    (row,) = json.loads(out.read_text())["runs"][0]["results"]
    assert (row["card"], row["layout"], row["rank"], row["refused"]) == ("qwen3-30b-a3b", "tp4_ep4", 0, None)
    assert row["params"] > 0 and row["writes"] >= row["params"] and row["cache_file_bytes"] > 0


@pytest.mark.slow  # builds a Megatron-Bridge model on CPU
def test_gpu_export_check_smoke_on_cpu(tmp_path):
    out = tmp_path / "export.json"
    run(
        "scripts/gpu_export_check.py",
        *("--device", "cpu", "--hidden", "64", "--layers", "2", "--vocab", "256", "--repeat", "1"),
        *("--workdir", str(tmp_path / "work"), "--json-out", str(out)),
        timeout=400,
    )
    result = json.loads(out.read_text())
    assert result["ok"] is True and result["problems"] == [] and result["device"] == "cpu"
    (rank,) = result["ranks"]
    assert rank["vs_full"] == [] and rank["vs_checkpoint"] == [] and rank["fallback_names_equal"] is True


@pytest.mark.slow  # two Mooncake processes
def test_gpu_mooncake_check_smoke_between_host_buffers(tmp_path):
    """Host to host over tcp, three repeats: every repeat's bytes checked (the receiver cleared its buffer after
    answering, racing the next write, before this run existed)."""
    out = tmp_path / "mooncake.json"
    run("scripts/gpu_mooncake_check.py", "--mb", "8", "--repeats", "3", "--cases", "host:host", "--out", str(out))
    (case,) = json.loads(out.read_text())["cases"]
    assert (case["src"], case["dst"], case["bytes"], case["bytes_equal"]) == ("host", "host", 8 << 20, True)
    assert len(case["seconds"]) == 3


@pytest.mark.slow  # imports SGLang, builds a tiny replica
def test_measure_verify_first_push_smoke(tmp_path):
    out = tmp_path / "verify.json"
    run("scripts/measure_verify_first_push.py", "--smoke", "--out", str(out), timeout=400)
    result = json.loads(out.read_text())
    assert result, "the script wrote an empty report"

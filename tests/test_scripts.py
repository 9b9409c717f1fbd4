"""Every file in scripts/ runs in CI in a mode that needs no GPU, so none rots unseen.

Each script is listed in CHECKS with how: a smoke run here (small sizes, CPU; every Python script also shows its
`--help`), its `--help` (the whole argument parser: every option the source declares must be in it) for scripts
that need a GPU to do anything, or `bash -n` for shell scripts. Every check runs the script itself as a process:
a test elsewhere that merely names it does not count. A script not listed fails `test_every_script_has_a_ci_check`:
a new script comes with its check, and a smoke script with its smoke test here (`test_every_smoke_script_runs_here`).
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

SMOKE, HELP, SHELL = "smoke", "help", "shell"
CHECKS = {
    "bench_lifecycle.py": SMOKE,
    "measure_sync_overhead.py": SMOKE,
    "measure_plan_capture.py": SMOKE,
    "gpu_export_check.py": SMOKE,  # --device cpu: the same checks over gloo
    "gpu_mooncake_check.py": SMOKE,  # --cases host:host
    "gpu_staging_bandwidth.py": HELP,  # CUDA copies only
    "gpu_fp8_quant_check.py": SMOKE,  # --device cpu: exactness and throughput of the eager path
    "gpu_verl_replica.py": SMOKE,  # --rollout loopback, run once: test_gpu_verl_replica.py's whole flow
    "grpo_check.py": SMOKE,  # summary on recorded logs (probe and fresh: test_grpo_check.py)
    "grpo_report.py": SMOKE,  # JSON and table from a recorded run (more: test_grpo_report.py)
    "measure_verify_first_push.py": SMOKE,  # --smoke: tiny model, one repeat
    "cost_growth.py": HELP,  # its --device cpu --width tiny run (loopback rollout) is in tests/test_real_sizes.py
    "gpu_real_sizes.sh": SHELL,  # and its dry step in tests/test_real_sizes.py
    "gpu_e2e.sh": SHELL,
    "gpu_grpo_run.sh": SHELL,
    "gpu_stack_install.sh": SHELL,  # and --dry-run below
    "gpu_wheels.sh": SHELL,
    "setup.sh": SHELL,
    "private_dir.sh": SHELL,  # sourced by the gpu_*.sh scripts; its checks: tests/test_private_dirs.py
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


@pytest.mark.parametrize("name", [n for n, how in CHECKS.items() if n.endswith(".py")])
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


RUN_IN = {"gpu_verl_replica.py": "test_gpu_verl_replica.py"}  # run once, in the module holding its checks


def test_every_smoke_script_runs_here():
    """A smoke script's check is a run of it in this file (`run("scripts/<name>", ...)` in some test here), or in
    the module RUN_IN names for it (its `ROOT / "scripts" / "<name>"` run as a subprocess there)."""
    source = Path(__file__).read_text()
    ran = set(re.findall(r'"scripts/([a-z0-9_]+\.py)"', source))
    for name, module in RUN_IN.items():
        other = (Path(__file__).parent / module).read_text()
        if f'ROOT / "scripts" / "{name}"' in other and "subprocess.run(" in other:
            ran.add(name)
    missing = sorted(n for n, how in CHECKS.items() if how == SMOKE and n not in ran)
    assert missing == [], f"smoke scripts no test here runs: {missing}"


def test_grpo_check_summary_smoke(tmp_path):
    from test_grpo_check import CHECKED, console

    lines = ["step:0 - val-core/tiny_repeat/reward/mean@1:0.01", CHECKED] + [console(i) for i in (1, 2, 3, 4)]
    (tmp_path / "run.log").write_text("\n".join(lines) + "\n")
    (tmp_path / "compare.json").write_text(json.dumps({"equal": True, "version": "4"}))
    (tmp_path / "probe.json").write_text(json.dumps({"records": {"0": {}, "4": {}, "10": {}}}))
    out = tmp_path / "summary.json"
    run(
        "scripts/grpo_check.py",
        *("summary", "--log", str(tmp_path / "run.log"), "--metrics", str(tmp_path / "metrics.jsonl")),
        *("--probe", str(tmp_path / "probe.json"), "--compare", str(tmp_path / "compare.json")),
        *("--steps", "4", "--rc", "0", "--out", str(out)),
    )
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["steps_completed"] == 4


def test_grpo_report_smoke(tmp_path):
    from test_grpo_report import write_run

    folder = write_run(tmp_path / "p2p", [5.0, 1.0, 1.0], paused=True)
    out = tmp_path / "out"
    run("scripts/grpo_report.py", str(folder), "--names", "p2p", "--out-dir", str(out), "--table", "table.txt")
    assert json.loads((out / "p2p.json").read_text())["checks"]["ok"] is True
    assert "p2p" in (out / "table.txt").read_text()


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


def test_gpu_fp8_quant_check_smoke_on_cpu(tmp_path):
    """The CPU run checks every case against the reference (the eager reference and quantize_many on CPU) and
    times the eager path; the fused kernel is CUDA-only and is reported absent, not faked."""
    out = tmp_path / "fp8.json"
    run("scripts/gpu_fp8_quant_check.py", "--device", "cpu", "--experts", "2", "--repeats", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["exactness"]["cases"] == 6 * 3 * 3 * 2 and report["exactness"]["unequal"] == []  # 2 ways
    assert "fused" not in report["throughput"] and report["throughput"]["eager"]["g_elements_per_s"] > 0


@pytest.mark.slow  # imports SGLang, builds a tiny replica
def test_measure_verify_first_push_smoke(tmp_path):
    out = tmp_path / "verify.json"
    run("scripts/measure_verify_first_push.py", "--smoke", "--out", str(out), timeout=400)
    result = json.loads(out.read_text())
    assert result, "the script wrote an empty report"


# ---- the SGLang 0.5.21 stack: the part checks and commands of its install, without a GPU -----------------------


def _carried_parts(tmp_path: Path) -> Path:
    """A carried folder as `gpu_wheels.sh --sglang 0.5.21` leaves it: a tar of wheels split in parts, their sums."""
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "part.aa").write_bytes(b"first part of the wheels tar")
    (carried / "part.ab").write_bytes(b"second part")
    sums = subprocess.run(["sha256sum", "part.aa", "part.ab"], cwd=carried, capture_output=True, text=True, check=True)
    (carried / "parts.sha256").write_text(sums.stdout)
    return carried


def _install_dry_run(tmp_path: Path, carried: Path) -> subprocess.CompletedProcess:
    args = [
        "--dry-run",
        "--carried",
        str(carried),
        "--stack",
        str(tmp_path / "stack"),
        "--site",
        str(tmp_path / "site"),
    ]
    return subprocess.run(["bash", str(SCRIPTS / "gpu_stack_install.sh"), *args], capture_output=True, text=True)


def test_gpu_stack_install_dry_run_checks_the_parts_and_prints_the_commands(tmp_path):
    done = _install_dry_run(tmp_path, _carried_parts(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "parts ok: 2 in" in done.stdout
    site = tmp_path / "site"
    pip = f"python3 -m pip install -q --no-index --no-deps --no-compile --target {site} {tmp_path}/stack/wheels/*.whl"
    assert pip in done.stdout
    assert f"ln -sfn sm90 {site}/sgl_kernel/sm100" in done.stdout
    assert done.stdout.splitlines()[-1] == f"export PYTHONPATH={site}:{ROOT}"
    assert not site.exists() and not (tmp_path / "stack").exists(), "a dry run installs nothing"


def test_gpu_stack_install_dry_run_refuses_a_damaged_or_missing_part(tmp_path):
    carried = _carried_parts(tmp_path)
    (carried / "part.ab").write_bytes(b"second part, cut")
    done = _install_dry_run(tmp_path, carried)
    assert done.returncode == 3 and "damaged" in done.stdout, done.stdout + done.stderr
    (carried / "part.ab").unlink()
    done = _install_dry_run(tmp_path, carried)
    assert done.returncode == 3 and f"missing {carried}/part.ab" in done.stdout, done.stdout + done.stderr
    (carried / "parts.sha256").unlink()
    done = _install_dry_run(tmp_path, carried)
    assert done.returncode == 3 and f"no {carried}/parts.sha256" in done.stdout, done.stdout + done.stderr


def test_stack_scripts_name_an_unknown_sglang_version(tmp_path):
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_wheels.sh"), "--sglang", "0.4.0", str(tmp_path / "dest")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "builds 0.5.12 (the default) or 0.5.21" in done.stderr, done.stderr
    assert not (tmp_path / "dest").exists()
    e2e = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_e2e.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "SGLANG_STACK": "0.4.0", "OUT": str(tmp_path / "out")},
    )
    assert e2e.returncode == 2 and "SGLANG_STACK=0.4.0: expected 0.5.12" in e2e.stderr, e2e.stderr


def _wheel_specs(tmp_path: Path, *args: str) -> list[str]:
    """The requirement list `gpu_wheels.sh` hands to `pip download` (a stand-in python records it and stops)."""
    record = tmp_path / "argv.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {record}\nexit 1\n')
    fake.chmod(0o755)
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_wheels.sh"), *args, str(tmp_path / "dest")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": str(fake)},
    )
    assert done.returncode == 1, done.stderr
    argv = record.read_text().split("\n")
    assert argv[:2] == ["-m", "pip"] and "download" in argv and str(tmp_path / "dest" / "wheels") in argv
    return [a for a in argv if "==" in a]


def test_gpu_wheels_sglang_0521_overrides_the_pins_it_changes_and_keeps_the_rest(tmp_path):
    old = _wheel_specs(tmp_path)
    new = _wheel_specs(tmp_path, "--sglang", "0.5.21")
    assert {"sglang==0.5.12", "transformers==5.10.4", "flashinfer-python==0.6.11.post1"} <= set(old)
    assert not any(s.startswith("torch==") for s in old), "the 0.5.12 stack runs on the device's torch"
    assert {
        "sglang==0.5.21",
        "sglang-kernel==0.4.7",
        "torch==2.13.0",
        "triton==3.7.1",
        "transformers==5.12.1",
        "nvidia-nccl-cu13==2.29.7",
        "nvidia-cudnn-cu13==9.20.0.48",
        "compressed-tensors==0.18.0",
    } <= set(new)
    names = [s.split("==")[0] for s in new]
    assert len(names) == len(set(names)), f"a package pinned twice: {sorted(n for n in names if names.count(n) > 1)}"
    changed = {s.split("==")[0] for s in new} & {s.split("==")[0] for s in old}
    kept = {s for s in old if s.split("==")[0] in changed} & set(new)
    assert {
        "verl==0.9.1",
        "megatron-core==0.19.2",
        "megatron-bridge==0.6.2",
        "ray==2.60.0",
        "mooncake-transfer-engine-cuda13==0.3.14",
    } <= kept


def test_gpu_wheels_nixl_builds_only_nixl_and_its_cuda13_backend(tmp_path):
    """`--nixl` (verl's nixl engine, BACKEND=nixl on the H200): the shim and its CUDA 13 build, pinned together
    (the shim 1.5.2 asks for nixl-cu13 1.5.2, which has no CPython 3.12 x86-64 wheel), nothing else."""
    assert _wheel_specs(tmp_path, "--nixl") == ["nixl==1.5.1", "nixl-cu13==1.5.1"]

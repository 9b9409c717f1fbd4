"""Runs witness process groups and replica comparisons under a chosen SGLang release.

Each SGLang release runs in fresh processes: 0.5.12 is the venv's own; the others live in
`.venv/sglang-<version>` (scripts/setup.sh installs them), put first on the path. At most four witness
processes run at once (the machine is shared). support/replica_matrix.py runs the replica-exact matrix with these.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent
# The replica-exact matrix: the oldest and newest supported releases, and one between them (0.5.21: the
# first whose runtime context places ranks itself, without create_context/use_context).
SGLANG_DIRS = {"0.5.12": None, "0.5.21": REPO / ".venv" / "sglang-0.5.21", "0.5.23": REPO / ".venv" / "sglang-0.5.23"}


def version_env(version: str) -> dict:
    env = dict(os.environ)
    paths = [str(REPO)]
    if SGLANG_DIRS[version] is not None:
        paths.insert(0, str(SGLANG_DIRS[version]))
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    return env


def write_spec(path: Path, phases: list[tuple[int, list[dict]]], out: Path) -> Path:
    """A witness spec: phases of (world size, jobs), run in order by the same processes."""
    # file:// rendezvous: no port can be taken by another process between writing the spec and using it
    spec = {
        "out": str(out),
        "phases": [
            {"world": w, "init": f"file://{path.parent / f'{path.stem}.rdzv{i}'}", "jobs": jobs}
            for i, (w, jobs) in enumerate(phases)
        ],
    }
    path.write_text(json.dumps(spec))
    return path


def start_witnesses(version: str, spec: Path, log_dir: Path) -> list[subprocess.Popen]:
    world = max(p["world"] for p in json.loads(spec.read_text())["phases"])
    procs = []
    for rank in range(world):
        log = open(log_dir / f"{spec.stem}.rank{rank}.log", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SUPPORT / "replica_witness.py"), str(spec), str(rank)],
                env=version_env(version),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        )
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float, what: str) -> None:
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [p.args for p in procs if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{what}: processes failed: {failed}")


def start_compare(version: str, specs: list[Path], log_dir: Path) -> tuple[subprocess.Popen, Path]:
    log_path = log_dir / f"compare-{version}.log"
    proc = subprocess.Popen(
        [sys.executable, str(SUPPORT / "replica_compare.py"), *map(str, specs)],
        env=version_env(version),
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    return proc, log_path


def read_results(log_path: Path) -> list[dict]:
    for line in log_path.read_text().splitlines():
        if line.startswith("RESULTS "):
            return json.loads(line[len("RESULTS ") :])
    tail = "\n".join(log_path.read_text().splitlines()[-30:])
    raise RuntimeError(f"no results in {log_path}:\n{tail}")

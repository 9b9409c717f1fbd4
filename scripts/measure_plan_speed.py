"""Seconds of a cold and a warm `verl-p2p plan` per model at README's layouts, and its figures against a reference.

Cold: a fresh plan cache (SGLang imported, the write plans captured); warm: the same command again (plans read
from the cache). Each run is a fresh process; its wall and CPU seconds and the host's load average beside them
(the host may be shared: CPU seconds are the steadier figure). The reference is a committed plan JSON (every
key it shares with the output must be equal) or `--every-rank` (the same command capturing every rank at every
layer: the shortcut's check at full scale).

    PYTHONPATH=$PWD .venv/bin/python scripts/measure_plan_speed.py --out docs/measurements/plan_speed_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "qwen3-30b-a3b": (
        "--model qwen3-30b-a3b --trainer tp=4,ep=8 --rollout tp=8,ep=8x4",
        "every-rank",
    ),
    "qwen3-30b-a3b anchors": ("--model qwen3-30b-a3b", "docs/measurements/plan_anchors.json:models.qwen3-30b-a3b"),
    "kimi-k2 anchors (bf16)": ("--model kimi-k2", "docs/measurements/plan_anchors.json:models.kimi-k2"),
    "kimi-k2 fp8 4 x 32": (
        "--model kimi-k2 --rollout-quant fp8 --trainer tp=8,ep=64,dp=32 "
        "--rollout tp=32,ep=32,moe_dense_tp=1,shared_tp=1x4",
        "docs/measurements/plan_kimi_k2_fp8_tp32.json",
    ),
    "deepseek-v3 fp8 tp8 dp_attn8": (
        "--model deepseek-v3 --rollout-quant fp8 --trainer tp=8,ep=8 --rollout tp=8,ep=8,dp_attn=8 --gpu-mem 141",
        "every-rank",
    ),
}
IGNORED = ("plans", "what", "command", "goal", "result", "why_over", "published")


def run(args: str, cache: str, extra: tuple[str, ...] = ()) -> tuple[dict, float, float, list[float]]:
    """(JSON output, wall s, CPU s of the child, load average before) of one `verl-p2p plan` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = list(os.getloadavg())
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "verl_p2p.cli", "plan", *args.split(), "--json", "--plan-cache-dir", cache, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"plan {args} failed ({done.returncode}): {done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(done.stdout), wall, cpu, load


def reference(spec: str, args: str) -> tuple[dict, str]:
    if spec == "every-rank":
        with tempfile.TemporaryDirectory() as cache:
            out, wall, cpu, load = run(args, cache, ("--every-rank",))
        return out, f"the same command with --every-rank ({wall:.1f} s wall, {cpu:.1f} s CPU, load {load[0]:.1f})"
    path, _, key = spec.partition(":")
    data = json.loads((ROOT / path).read_text())
    for part in filter(None, key.split(".")):
        data = data[part]
    return data, f"{path}{' ' + key if key else ''} (committed)"


def differences(out: dict, ref: dict) -> list[str]:
    """The keys of `ref` (recursively, list items by position) whose values `out` does not repeat; a key the
    reference lacks (added to the output since) is not compared."""
    found = []
    for k in ref:
        if k in IGNORED or k not in out:
            continue
        mine, theirs = out[k], ref[k]
        if isinstance(theirs, list) and isinstance(mine, list) and all(isinstance(x, dict) for x in theirs):
            if len(mine) != len(theirs):
                found.append(k)
            pairs = enumerate(zip(mine, theirs, strict=False))
            found += [f"{k}[{i}].{d}" for i, (a, b) in pairs for d in differences(a, b)]
        elif isinstance(theirs, dict) and isinstance(mine, dict):  # keys added since the reference: not compared
            found += [f"{k}.{d}" for d in differences(mine, theirs)]
        elif mine != theirs:
            found.append(k)
    return sorted(found)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of: " + ", ".join(CASES))
    parser.add_argument("--no-reference", action="store_true", help="time only (no --every-rank runs)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for name in args.cases.split(","):
        plan_args, ref_spec = CASES[name]
        with tempfile.TemporaryDirectory() as cache:
            cold, cold_s, cold_cpu, cold_load = run(plan_args, cache)
            warm, warm_s, warm_cpu, warm_load = run(plan_args, cache)
        row = {
            "case": name,
            "command": f"verl-p2p plan {plan_args}",
            "cold_s": round(cold_s, 2),
            "cold_cpu_s": round(cold_cpu, 2),
            "cold_load_average": [round(x, 2) for x in cold_load],
            "warm_s": round(warm_s, 2),
            "warm_cpu_s": round(warm_cpu, 2),
            "warm_load_average": [round(x, 2) for x in warm_load],
            "captures": len([p for p in cold["plans"] if not p["cached"]]),
            "predicted_s": cold.get("predicted_s", [a["predicted_s"] for a in cold.get("anchors", [])]),
        }
        if not args.no_reference:
            ref, where = reference(ref_spec, plan_args)
            row["reference"] = where
            row["differences"] = differences(cold, ref)
            row["warm_equals_cold"] = differences(warm, cold) == []
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "what": "seconds of a cold (fresh plan cache) and a warm verl-p2p plan per model at README's layouts, each "
        "in a fresh process; figures compared with the reference (differences: keys whose values differ)",
        "command": "PYTHONPATH=$PWD .venv/bin/python scripts/measure_plan_speed.py --out "
        "docs/measurements/plan_speed_cpu.json",
        "host": {"node": platform.node(), "cpus": os.cpu_count(), "machine": platform.machine(),
                 "python": platform.python_version(), "processor": _cpu_model()},
        "results": results,
    }  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if any(r.get("differences") for r in results) else 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())

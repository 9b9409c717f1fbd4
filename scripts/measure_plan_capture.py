"""Plan capture at real scale: seconds cold and from the plan cache, and plan memory per rank (CPU, no GPU).

For each built-in model card and rollout layout, every rank's write plan is captured on `meta` (SGLang's own
model class and loader), written to a fresh plan cache, and read back in a fresh `PlanCache`; the plan's
memory is the deep size of its Python objects (shared objects counted once).

    PYTHONPATH=$PWD .venv/bin/python scripts/measure_plan_capture.py --out docs/measurements/plans_real_scale.json

`--speed`: seconds of a cold and a warm `verl-p2p plan` per model at README's layouts (each a fresh process, wall
and CPU seconds and the load average beside them: the host may be shared), every figure compared with a
committed plan JSON or with `--every-rank` (the same command capturing every rank at every layer):

    PYTHONPATH=$PWD .venv/bin/python scripts/measure_plan_capture.py --speed --out docs/measurements/plan_speed_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LAYOUTS = {
    "tp4_ep4": {"tp_size": 4, "ep_size": 4},
    "tp8_ep8": {"tp_size": 8, "ep_size": 8},
    "tp8_ep8_dpattn8": {"tp_size": 8, "ep_size": 8, "dp_size": 8, "enable_dp_attention": True},
}


def deep_size(obj, seen: set | None = None) -> int:
    """Bytes of `obj` and everything it references (each object once); dtypes and None are shared singletons."""
    seen = set() if seen is None else seen
    stack, total = [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or o is None or isinstance(o, (torch.dtype, bool)):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif hasattr(o, "__dataclass_fields__"):
            stack.extend(getattr(o, f) for f in o.__dataclass_fields__)
    return total


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


def run_plan(args: str, cache: str, extra: tuple[str, ...] = ()) -> tuple[dict, float, float, list[float]]:
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
            out, wall, cpu, load = run_plan(args, cache, ("--every-rank",))
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


def speed_main(args: argparse.Namespace) -> int:
    """--speed: a cold and a warm `verl-p2p plan` per case, in fresh processes, figures against a reference."""
    results = []
    for name in args.cases.split(","):
        plan_args, ref_spec = CASES[name]
        with tempfile.TemporaryDirectory() as cache:
            cold, cold_s, cold_cpu, cold_load = run_plan(plan_args, cache)
            warm, warm_s, warm_cpu, warm_load = run_plan(plan_args, cache)
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
        "command": "PYTHONPATH=$PWD .venv/bin/python scripts/measure_plan_capture.py --speed --out "
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cards", default="qwen3-30b-a3b,qwen3-235b-a22b")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--ranks", default="all", help="'all' or a comma list of rank indices")
    parser.add_argument("--layers", type=int, default=None, help="shorten the models (default: the real depth)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--append", action="store_true", help="add to the results already in --out")
    parser.add_argument("--speed", action="store_true", help="time whole `verl-p2p plan` runs instead (--cases)")
    parser.add_argument("--cases", default=",".join(CASES), help="(--speed) comma list of: " + ", ".join(CASES))
    parser.add_argument("--no-reference", action="store_true", help="(--speed) time only, compare nothing")
    args = parser.parse_args()
    if args.speed:
        return speed_main(args)

    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()
    t0 = time.perf_counter()
    import sglang.srt.model_loader.loader  # noqa: F401  (the process-wide import, measured apart)

    import_s = time.perf_counter() - t0
    from verl_p2p.planning.hf_names import hf_tensor_specs
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.planning.model_cards import model_card
    from verl_p2p.replica.plan import build_meta_model, capture_write_plan, check_syncable
    from verl_p2p.replica.plan_cache import PlanCache, PlanKey, config_digest
    from verl_p2p.replica.rank_context import (
        RankContext,
        installed_sglang_version,
        plan_fingerprint,
        server_args_field_names,
    )

    version = installed_sglang_version()
    fields = server_args_field_names(version)
    results = []
    with tempfile.TemporaryDirectory(prefix="verl_p2p_plans_") as cache_dir:
        for card in args.cards.split(","):
            cfg = model_card(card, args.layers)
            specs = {n: (s, getattr(torch, d)) for n, s, d in hf_tensor_specs(cfg)}
            digest = config_digest(cfg, specs)
            for layout_name in args.layouts.split(","):
                server_args = dict(LAYOUTS[layout_name], dtype="bfloat16", device="cpu")
                tp = server_args["tp_size"]
                ranks = range(tp) if args.ranks == "all" else [int(r) for r in args.ranks.split(",") if int(r) < tp]
                for rank in ranks:
                    layout = layout_from_server_args(server_args, rank)
                    gc.collect()
                    c0, t0 = time.process_time(), time.perf_counter()
                    ctx = RankContext(server_args, layout, cfg)
                    t1 = time.perf_counter()
                    model = build_meta_model(ctx)
                    t2 = time.perf_counter()
                    plan = capture_write_plan(ctx, model, specs)
                    t3, c3 = time.perf_counter(), time.process_time()
                    key = PlanKey(version, digest, layout, plan_fingerprint(server_args, fields))
                    path = PlanCache(cache_dir).save(key, plan)
                    t4 = time.perf_counter()
                    del model, ctx
                    gc.collect()
                    c5, t5 = time.process_time(), time.perf_counter()
                    again = PlanCache(cache_dir).load(key)
                    t6, c6 = time.perf_counter(), time.process_time()
                    assert again == plan, "the cached plan differs from the captured one"
                    try:
                        check_syncable(plan)
                        refused = None
                    except Exception as exc:  # DeepSeek-style post-load derivations
                        refused = str(exc)[:200]
                    row = {
                        "card": card,
                        "layers": cfg["num_hidden_layers"],
                        "layout": layout_name,
                        "server_args": server_args,
                        "rank": rank,
                        "params": len(plan.params),
                        "writes": sum(len(p.writes) for p in plan.params.values()),
                        "hf_tensors": len(plan.hf_specs),
                        "rank_bytes": plan.nbytes,
                        "cold_s": t3 - t0,
                        "cold_cpu_s": c3 - c0,
                        "cold_context_s": t1 - t0,
                        "cold_model_s": t2 - t1,
                        "cold_capture_s": t3 - t2,
                        "cache_save_s": t4 - t3,
                        "cache_load_s": t6 - t5,
                        "cache_load_cpu_s": c6 - c5,
                        "cache_file_bytes": os.path.getsize(path),
                        "plan_memory_bytes": deep_size(plan),
                        "plan_memory_from_cache_bytes": deep_size(again),
                        "derived_tensors": len(plan.derived),
                        "refused": refused,
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)
                    del plan, again
    run = {
        "command": "PYTHONPATH=$PWD .venv/bin/python scripts/measure_plan_capture.py " + " ".join(sys.argv[1:]),
        "sglang_version": version,
        "torch_version": torch.__version__,
        "sglang_import_s": import_s,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "load_average_at_end": os.getloadavg(),
        "results": results,
    }
    out = {
        "what": "rollout write-plan capture on meta at real model shapes: seconds cold (rank context + meta model "
        "+ capture; the process-wide SGLang import apart) and from the plan cache, plan memory per rank",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs (load average above "
        "the core count: wall seconds are upper bounds, *_cpu_s is this process's CPU time), no GPU",
        "runs": [run],
    }
    if args.out:
        if args.append and os.path.exists(args.out):
            with open(args.out) as f:
                out["runs"] = json.load(f)["runs"] + [run]
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plan capture at real scale: seconds cold and from the plan cache, and plan memory per rank (CPU, no GPU).

For each built-in model card and rollout layout, every rank's write plan is captured on `meta` (SGLang's own
model class and loader), written to a fresh plan cache, and read back in a fresh `PlanCache`; the plan's
memory is the deep size of its Python objects (shared objects counted once).

    PYTHONPATH=$PWD .venv/bin/python scripts/measure_plan_capture.py --out docs/measurements/plans_real_scale.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import sys
import tempfile
import time

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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cards", default="qwen3-30b-a3b,qwen3-235b-a22b")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--ranks", default="all", help="'all' or a comma list of rank indices")
    parser.add_argument("--layers", type=int, default=None, help="shorten the models (default: the real depth)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--append", action="store_true", help="add to the results already in --out")
    args = parser.parse_args()

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

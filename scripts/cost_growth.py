"""How a sync's cost grows with depth (issue 35, part 3): Qwen3-30B-A3B shapes synced at several depths.

    # the H200 (scripts/gpu_real_sizes.sh): real widths, one depth per call, the JSON grows with --append
    python3 scripts/cost_growth.py --device cuda --width real --rollout sglang --depths 24 --quant bf16,fp8 \
        --out $OUT/cost_growth_h200.json --append
    # any machine: the plan captures only (seconds cold and cached per rank, bytes, tensors)
    python3 scripts/cost_growth.py --plan-only --depths 2,6,12,24,48 --layouts tp2_ep2,tp1 --out plans.json
    # CPU proof of the script end to end (tests/test_real_sizes.py): tiny width, the loopback rollout
    python3 scripts/cost_growth.py --device cpu --width tiny --depths 2,4 --out /tmp/cg.json

Each depth is one `verl-p2p e2e` harness (`verl_p2p/e2e/run.py`: rollout under test, trainer process, a fresh
rollout for the expectations, the weights checker on the first sync, raw-replay syncs, the kill drill for the
first sync after a trainer restart), with the trainer process's memory sampled from outside, and one plan
capture per rollout layout (`verl-p2p plan`'s `Planner`: a fresh plan cache, then read back). The PNG puts the
push and the raw Mooncake writes of the same lists against bytes; the JSON states issue 35's goals as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verl_p2p.e2e.real_sizes import as_size_overrides, qwen3_30b_a3b, sync_bytes  # noqa: E402

LAYOUTS = {"tp1": "tp=1", "tp2_ep2": "tp=2,ep=2"}
GOALS = {
    "paused_over_steady": 1.5,  # first sync (less the weights checker) and first after a trainer restart
    "push_over_raw": 1.25,  # at >= 24 layers
    "memory_over_slots": 1.10,  # trainer memory beyond the model over the bytes of its two staging slots
    "plan_cold_s": 10.0,  # per rank at 48 layers
    "plan_cached_s": 1.0,
    "fp8_over_bf16_convert": 0.25,  # FP8 conversion GB/s over bf16's at >= 24 layers
}
CONFIG_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "vocab_size",
    "quantization_config",
)


def model_config(width: str, depth: int) -> dict[str, Any]:
    """The HF config of the model synced at `depth`: Qwen3-30B-A3B's real widths, or the sandbox's tiny MoE."""
    if width == "real":
        return qwen3_30b_a3b(depth)
    from verl_p2p.sandbox.tiny import tiny_config_dict

    return tiny_config_dict("qwen3_moe", num_hidden_layers=depth)


# ---- plan capture ----------------------------------------------------------------------------------------------


def plan_capture(cfg: dict[str, Any], layout: str, cache_dir: str, dtype: str) -> dict[str, Any]:
    """Every rank's write plan of `layout`, captured cold into an empty plan cache, then read back from it by a
    new cache object (what a restarted trainer does): seconds per rank, bytes per rank, tensors."""
    import torch

    from verl_p2p.cli.plan import Planner
    from verl_p2p.planning.hf_names import hf_tensor_specs
    from verl_p2p.planning.sync_estimate import parse_parallelism, rollout_server_args
    from verl_p2p.replica.plan_cache import PlanCache

    cfg = dict(cfg, torch_dtype=dtype)
    specs = {n: (s, getattr(torch, d)) for n, s, d in hf_tensor_specs(cfg)}
    par = parse_parallelism(LAYOUTS[layout], ("tp", "ep"))
    server_args = rollout_server_args(par, dtype=dtype)
    if not torch.cuda.is_available():
        server_args["device"] = "cpu"  # as `verl-p2p plan` does: the plan's bytes do not depend on it
    ranks = []
    for rank in range(par.tp):
        gc.collect()
        cold = Planner(cfg, specs, PlanCache(cache_dir), quiet=True)
        c0 = time.process_time()
        plan = cold.rank_plan(server_args, rank)
        c1 = time.process_time()
        cached = Planner(cfg, specs, PlanCache(cache_dir), quiet=True)
        again = cached.rank_plan(server_args, rank)
        c2 = time.process_time()
        if cold.captures[0]["cached"] or not cached.captures[0]["cached"] or again != plan:
            raise RuntimeError(f"{layout} rank {rank}: the plan cache did not round-trip the captured plan")
        ranks.append(
            {
                "rank": rank,
                "cold_s": cold.captures[0]["seconds"],
                "cached_s": cached.captures[0]["seconds"],
                "cold_cpu_s": c1 - c0,  # this process's CPU time: the wall seconds count other jobs on the cores
                "cached_cpu_s": c2 - c1,
                "bytes": plan.nbytes,
                "params": len(plan.params),
                "writes": sum(len(p.writes) for p in plan.params.values()),
            }
        )
    return {
        "layout": layout,
        "server_args": server_args,
        "hf_tensors": len(specs),
        "ranks": ranks,
        "cold_s_max": max(r["cold_s"] for r in ranks),
        "cached_s_max": max(r["cached_s"] for r in ranks),
    }


# ---- the trainer's memory, sampled from outside its process -----------------------------------------------------


@dataclass
class MemorySamples:
    """One trainer process: its memory when its model was loaded (the baseline) and the peak of later samples."""

    pid: int
    host_baseline: int
    gpu_baseline: int | None
    host_peak: int = 0
    gpu_peak: int | None = None


def _host_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _gpu_used(pid: int) -> int | None:
    """The GPU memory nvidia-smi attributes to `pid` (None without nvidia-smi or when it does not list the pid,
    as inside some containers)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1]) << 20
    return None


class TrainerMemory:
    """Samples the harness's current trainer process (a kill drill replaces it) until stopped."""

    def __init__(self, harness: Any, gpu: bool, period_s: float = 0.2):
        self.harness, self.gpu, self.period_s = harness, gpu, period_s
        self.samples: dict[int, MemorySamples] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def baseline(self) -> None:
        """The current trainer's memory now (its model loaded, nothing applied or pushed yet), then sampling."""
        self._sample()
        self._thread.start()

    def _sample(self) -> None:
        trainer = getattr(self.harness, "trainer", None)
        pid = trainer.pid if trainer is not None else None
        if pid is None:
            return
        host = _host_rss(pid)
        if host is None:
            return
        gpu = _gpu_used(pid) if self.gpu else None
        s = self.samples.get(pid)
        if s is None:
            self.samples[pid] = MemorySamples(pid, host, gpu, host, gpu)
            return
        s.host_peak = max(s.host_peak, host)
        if gpu is not None:
            s.gpu_peak = max(s.gpu_peak or 0, gpu)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def stop(self) -> list[MemorySamples]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        return list(self.samples.values())


# ---- one depth: the e2e harness --------------------------------------------------------------------------------


@dataclass
class DepthRun:
    """What one e2e harness at one depth and rollout quantization measured."""

    depth: int
    quant: str
    passed: bool
    bytes: int | None
    report: dict[str, Any]
    memory: list[MemorySamples] = field(default_factory=list)
    seconds: float = 0.0


def e2e_args(
    args: argparse.Namespace, size_key: str, quant: str, workdir: Path, mem_fraction: float | None
) -> argparse.Namespace:
    """The namespace `verl-p2p e2e` would parse for this depth: one model, the kill drill only (its recovery sync
    is the first after a trainer restart), `--raw-syncs` raw-replay syncs."""
    from verl_p2p.e2e.run import harness_args

    return harness_args(
        rollout=args.rollout,
        models=["qwen3_moe"],
        size=size_key,
        device=args.device,
        syncs=args.syncs,
        raw_syncs=args.raw_syncs,
        drills=["kill"],
        bucket_mb=args.bucket_mb,
        transfer_timeout=args.transfer_timeout,
        http_timeout=args.http_timeout,
        bootstrap_port=args.bootstrap_port,
        mem_fraction=mem_fraction,
        fp8=quant == "fp8",
        workdir=str(workdir),
    )


async def _harness_run(ns: argparse.Namespace, workdir: Path, gpu: bool) -> tuple[dict, list[MemorySamples]]:
    from verl_p2p.e2e.run import Harness

    harness = Harness(ns, "qwen3_moe", 0, workdir)
    memory = TrainerMemory(harness, gpu)
    try:
        await harness.start()
        memory.baseline()
        await harness.run()
        return harness.report(), memory.stop()
    except Exception as exc:  # noqa: BLE001 - the depth's failure is reported, the next depth still runs
        import traceback

        report = {**harness.report(), "passed": False, "error": "".join(traceback.format_exception(exc))[-4000:]}
        return report, memory.stop()
    finally:
        harness.stop()


def run_depth(args: argparse.Namespace, depth: int, quant: str, mem_fraction: float | None) -> DepthRun:
    """One harness at `depth`: its size is registered in the e2e's SIZES under a key of its own."""
    from verl_p2p.e2e import run as e2e

    key = f"cost_growth_{args.width}_l{depth}"
    e2e.SIZES[key] = {"qwen3_moe": as_size_overrides(model_config(args.width, depth))}
    with tempfile.TemporaryDirectory(prefix=f"cost-growth-l{depth}-", dir=args.workdir) as tmp:
        t0 = time.perf_counter()
        ns = e2e_args(args, key, quant, Path(tmp), mem_fraction)
        report, memory = asyncio.run(_harness_run(ns, Path(tmp), args.device == "cuda"))
    return DepthRun(
        depth, quant, bool(report.get("passed")), report.get("push_bytes"), report, memory, time.perf_counter() - t0
    )


# ---- figures and goals -----------------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def depth_figures(run: DepthRun, tensors: int, slot_bytes: int) -> dict[str, Any]:
    """Issue 35's figures of one depth from the harness's sync records."""
    syncs = [s for s in run.report.get("syncs", []) if s["outcome"] == "ok" and s["push"]]
    plain = [  # the steady state, as the e2e counts it: no first sync, drill, raw replay, restart or re-plan
        s
        for s in syncs
        if s["index"] > 0
        and not s["drill"]
        and not s["notes"].get("raw_replay")
        and not s["notes"].get("first_after_trainer_restart")
        and not s["notes"].get("replanned_in_pause")
    ]
    restart = [s for s in syncs if s["notes"].get("first_after_trainer_restart")]
    f = run.report.get("figures", {})

    def per(s: dict, key: str) -> float | None:
        p = s["push"]
        return p["bytes"] / p[key] / 1e9 if p.get(key) else None

    host_per_tensor = [(s["push"]["seconds"] - s["push"]["seconds_write_wait"]) / tensors for s in plain]
    raw = f.get("push_vs_raw") or []
    first_mem = run.memory[0] if run.memory else None
    beyond_host = first_mem.host_peak - first_mem.host_baseline if first_mem else None
    beyond_gpu = (
        first_mem.gpu_peak - first_mem.gpu_baseline
        if first_mem and first_mem.gpu_peak is not None and first_mem.gpu_baseline is not None
        else None
    )
    beyond = beyond_gpu if beyond_gpu is not None else beyond_host
    return {
        "depth": run.depth,
        "quant": run.quant,
        "passed": run.passed,
        "error": (run.report.get("error") or "").strip().splitlines()[-1:] or None,
        "bytes": run.bytes,
        "hf_tensors": tensors,
        "trainer_apply_before_pause_s": {
            "first": syncs[0]["phases"].get("prepare") if syncs else None,
            "after_trainer_restart": restart[0]["phases"].get("prepare") if restart else None,
            "steady_median": _median([s["phases"].get("prepare", 0.0) for s in plain]),
        },
        "paused_s": {
            "first": f.get("first_sync_paused_s"),
            "steady_median": f.get("steady_state_paused_median_s"),
            "after_trainer_restart": f.get("first_after_trainer_restart_paused_s"),
        },
        "push_s_median": _median([s["push"]["seconds"] for s in plain]),
        "raw_write_s": [r["raw_seconds"] for r in raw],
        "raw_write_s_median": _median([r["raw_seconds"] for r in raw]),
        "push_over_raw_median": f.get("push_over_raw_median"),
        "conversion_gbps_median": _median([g for s in plain if (g := per(s, "seconds_load")) is not None]),
        "push_gbps_median": _median([g for s in plain if (g := per(s, "seconds")) is not None]),
        "host_s_per_tensor_median": _median(host_per_tensor),
        "trainer_memory_beyond_model_bytes": {"host": beyond_host, "gpu": beyond_gpu},
        "memory_over_slots": beyond / slot_bytes if beyond is not None else None,
        "memory_samples": [asdict(m) for m in run.memory],
        "ratios": {
            "first_over_steady": f.get("first_over_steady"),
            "restart_over_steady": f.get("restart_over_steady"),
        },
        "harness_seconds": round(run.seconds, 1),
    }


def goals(rows: list[dict[str, Any]], plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of issue 35's goals as (value, limit, met) wherever this run measured it."""
    out = []

    def add(name: str, where: str, value: float | None, limit: float, at_most: bool = True) -> None:
        met = None if value is None else (value <= limit if at_most else value >= limit)
        out.append({"goal": name, "where": where, "value": value, "limit": limit, "met": met})

    for r in rows:
        where = f"{r['depth']} layers {r['quant']}"
        add("first_over_steady", where, r["ratios"]["first_over_steady"], GOALS["paused_over_steady"])
        add("restart_over_steady", where, r["ratios"]["restart_over_steady"], GOALS["paused_over_steady"])
        if r["depth"] >= 24:
            add("push_over_raw", where, r["push_over_raw_median"], GOALS["push_over_raw"])
        add("memory_over_slots", where, r["memory_over_slots"], GOALS["memory_over_slots"])
    for p in plans:
        if p["depth"] == 48:
            where = f"48 layers {p['layout']}"
            add("plan_cold_s", where, p["cold_s_max"], GOALS["plan_cold_s"])
            add("plan_cached_s", where, p["cached_s_max"], GOALS["plan_cached_s"])
    by = {(r["depth"], r["quant"]): r for r in rows}
    for (depth, quant), r in by.items():
        bf16 = by.get((depth, "bf16"))
        if quant == "fp8" and depth >= 24 and bf16 and r["conversion_gbps_median"] and bf16["conversion_gbps_median"]:
            ratio = r["conversion_gbps_median"] / bf16["conversion_gbps_median"]
            add("fp8_over_bf16_convert", f"{depth} layers", ratio, GOALS["fp8_over_bf16_convert"], at_most=False)
    return out


def growth_fit(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Push seconds = fixed + bytes / rate, fitted over the depths of one quantization (least squares): where the
    residual of a depth is large, the cost there grows with something besides bytes (tensors, plans)."""
    pts = [(r["bytes"], r["push_s_median"]) for r in rows if r["bytes"] and r["push_s_median"]]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    fixed = my - slope * mx
    return {
        "fixed_s": fixed,
        "gbps_marginal": 1 / slope / 1e9 if slope > 0 else None,
        "residual_s": {str(r["depth"]): r["push_s_median"] - (fixed + slope * r["bytes"]) for r in rows if r["bytes"]},
    }


def plot(rows: list[dict[str, Any]], path: str, title: str, dtype: str) -> None:
    """Sync (push) seconds and raw Mooncake write seconds against bytes, one line per quantization (labelled with
    what the rollout holds: `dtype` unless FP8)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for quant in sorted({r["quant"] for r in rows}):
        pts = sorted((r["bytes"] / 1e9, r) for r in rows if r["quant"] == quant and r["bytes"])
        if not pts:
            continue
        xs = [x for x, _ in pts]
        held = "fp8" if quant == "fp8" else dtype
        ax.plot(xs, [r["push_s_median"] for _, r in pts], "o-", label=f"sync push ({held})")
        ax.plot(xs, [r["raw_write_s_median"] for _, r in pts], "s--", label=f"raw Mooncake writes ({held})")
        ax.plot(xs, [r["paused_s"]["steady_median"] for _, r in pts], "^:", label=f"paused, steady ({held})")
        for x, r in pts:
            ax.annotate(f"{r['depth']}L", (x, r["push_s_median"] or 0), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("bytes per sync (GB)")
    ax.set_ylabel("seconds")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_goals(out_goals: list[dict[str, Any]]) -> None:
    for g in out_goals:
        value = "n/a" if g["value"] is None else f"{g['value']:.3f}"
        state = {True: "met", False: "MISSED", None: "not measured"}[g["met"]]
        print(f"goal {g['goal']:<24} {g['where']:<22} {value:>8} (limit {g['limit']:g}): {state}")


# ---- the command -----------------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="the trainer's device")
    p.add_argument("--width", choices=("real", "tiny"), default="real", help="Qwen3-30B-A3B's widths or tiny")
    p.add_argument("--rollout", choices=("sglang", "loopback"), default=None, help="default: sglang on cuda")
    p.add_argument("--depths", default="2,6,12,24", help="comma list of decoder layer counts")
    p.add_argument("--quant", default="bf16", help="comma list of rollout quantizations: bf16, fp8")
    p.add_argument("--layouts", default="tp1,tp2_ep2", help=f"plan capture layouts: {', '.join(LAYOUTS)}")
    p.add_argument("--plan-only", action="store_true", help="plan captures only (no sync: any machine)")
    p.add_argument("--syncs", type=int, default=4, help="plain syncs per depth (the first is checked)")
    p.add_argument("--raw-syncs", type=int, default=3, help="raw-replay syncs per depth (their median is reported)")
    p.add_argument("--bucket-mb", type=int, default=512, help="transfer slot size (two slots per source)")
    p.add_argument("--mem-fraction", type=float, default=None, help="SGLang mem_fraction_static (default: by GPU)")
    p.add_argument("--transfer-timeout", type=float, default=120.0)
    p.add_argument("--http-timeout", type=float, default=120.0)
    p.add_argument("--bootstrap-port", type=int, default=26789)
    p.add_argument("--workdir", default=None, help="where checkpoints are written (default: the temp dir)")
    p.add_argument("--out", required=True, help="the JSON")
    p.add_argument("--png", default=None, help="the plot (default: the JSON's path with .png)")
    p.add_argument("--append", action="store_true", help="add to the depths already in --out (one depth per call)")
    args = p.parse_args(argv)
    try:
        args.depths = [int(d) for d in args.depths.split(",") if d]
    except ValueError:
        p.error(f"--depths {args.depths!r}: give a comma list of integers, e.g. 2,6,12,24")
    args.quant = [q for q in args.quant.split(",") if q]
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.rollout = args.rollout or ("sglang" if args.device == "cuda" else "loopback")
    bad = [q for q in args.quant if q not in ("bf16", "fp8")] + [x for x in args.layouts if x not in LAYOUTS]
    if bad:
        p.error(f"unknown --quant/--layouts {bad}: quantizations are bf16, fp8; layouts {', '.join(LAYOUTS)}")
    if args.width == "real" and any(not 1 <= d <= 48 for d in args.depths):
        p.error(f"--depths {args.depths}: Qwen3-30B-A3B has 1..48 layers")
    if not args.plan_only:
        if args.width == "tiny" and "fp8" in args.quant:
            p.error("--quant fp8 needs --width real: block-FP8 needs widths that are multiples of 128")
        if args.rollout == "sglang" and args.device != "cuda":
            p.error("--rollout sglang needs --device cuda (SGLang's servers run on the GPU)")
        if args.width == "real" and args.device != "cuda":
            p.error("--width real syncs tens of GB: run it with --device cuda, or use --plan-only on a CPU")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    fractions = {  # refuses a depth that does not fit before anything is written or launched
        (d, q): _mem_fraction(args, model_config(args.width, d), q)
        for d in ([] if args.plan_only else args.depths)
        for q in args.quant
    }
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    import torch

    if args.device == "cpu" or not torch.cuda.is_available():
        from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

        install_cpu_stubs()  # SGLang's model classes import GPU kernels at import time
    t0 = time.perf_counter()
    import sglang.srt.model_loader.loader  # noqa: F401  (the process-wide import, apart from the first capture)

    import_s = time.perf_counter() - t0
    from verl_p2p.replica.rank_context import installed_sglang_version

    # the dtype the e2e's trainer and rollouts hold: bf16 on real SGLang, float32 with the loopback stand-in
    dtype = "bfloat16" if args.rollout == "sglang" or args.width == "real" else "float32"
    previous = json.loads(Path(args.out).read_text()) if args.append and Path(args.out).exists() else {}
    plans: list[dict] = list(previous.get("plans", []))
    rows: list[dict] = list(previous.get("depths", []))
    configs: dict[str, dict] = dict(previous.get("configs", {}))
    commands: list[str] = list(previous.get("commands", []))
    commands.append("python3 scripts/cost_growth.py " + " ".join(argv))
    slot_bytes = 2 * (args.bucket_mb << 20)
    for depth in args.depths:
        cfg = model_config(args.width, depth)
        configs[str(depth)] = {k: cfg[k] for k in CONFIG_FIELDS if k in cfg}
        tensors = sync_bytes(cfg).tensors
        for layout in args.layouts:
            with tempfile.TemporaryDirectory(prefix="cost-growth-plans-") as cache_dir:
                captured = plan_capture(cfg, layout, cache_dir, dtype)
            captured["depth"] = depth
            plans = [p for p in plans if (p["depth"], p["layout"]) != (depth, layout)] + [captured]
            print(
                f"{depth} layers {layout} ({dtype}): plan cold {captured['cold_s_max']:.2f} s, cached "
                f"{captured['cached_s_max']:.3f} s per rank (max), {captured['ranks'][0]['bytes'] / 1e9:.2f} GB "
                f"rank 0, {captured['hf_tensors']} tensors",
                flush=True,
            )
        if args.plan_only:
            continue
        for quant in args.quant:
            run = run_depth(args, depth, quant, fractions[depth, quant])
            row = depth_figures(run, tensors, slot_bytes)
            rows = [r for r in rows if (r["depth"], r["quant"]) != (depth, quant)] + [row]
            print(
                f"{depth} layers {quant}: {'PASS' if row['passed'] else 'FAIL'} {row['bytes']} B, paused first "
                f"{row['paused_s']['first']} steady {row['paused_s']['steady_median']} restart "
                f"{row['paused_s']['after_trainer_restart']}, push/raw {row['push_over_raw_median']}",
                flush=True,
            )
    rows.sort(key=lambda r: (r["quant"], r["depth"]))
    plans.sort(key=lambda p: (p["layout"], p["depth"]))
    out_goals = goals(rows, plans)
    report = {
        "what": "how a sync's cost grows with depth: Qwen3-30B-A3B shapes (issue 35, part 3)",
        "commands": commands,
        "width": args.width,
        "device": args.device,
        "rollout": args.rollout,
        "slot_bytes": slot_bytes,
        "dtype": dtype,
        "sglang_import_s": import_s,
        "sglang_version": installed_sglang_version(),
        "machine": f"{os.cpu_count()} CPU cores (shared: wall seconds are upper bounds, *_cpu_s this process's), "
        f"load average at the end {os.getloadavg()}",
        "configs": configs,
        "plans": plans,
        "depths": rows,
        "growth_fit": {q: growth_fit([r for r in rows if r["quant"] == q]) for q in sorted({r["quant"] for r in rows})},
        "goals": out_goals,
        "passed": all(r["passed"] for r in rows),
    }
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    if rows:
        title = "Qwen3-30B-A3B by depth" if args.width == "real" else "the sandbox's tiny Qwen3-MoE by depth (CPU)"
        plot(rows, args.png or str(Path(args.out).with_suffix(".png")), title, dtype)
    print_goals(out_goals)
    return 0 if report["passed"] else 1


def _mem_fraction(args: argparse.Namespace, cfg: dict, quant: str) -> float | None:
    """`--mem-fraction`, else (real SGLang) the one admitting both servers of this depth on the GPU at hand
    (`e2e/mem_fraction.py`), None for the loopback; a depth that does not fit there, or whose checkpoints do not
    fit on the disk, is refused with the arithmetic before anything is written."""
    from verl_p2p.e2e.mem_fraction import MemFractionError, mem_fraction_for
    from verl_p2p.e2e.real_sizes import disk_budget

    try:
        fraction = mem_fraction_for(
            [cfg],
            rollout=args.rollout,
            explicit=args.mem_fraction,
            quant=quant,
            slot_bytes=2 * (args.bucket_mb << 20),
            what=f"{cfg['num_hidden_layers']} layers {quant}",
        )
    except MemFractionError as exc:
        raise SystemExit(str(exc)) from exc
    if fraction.value is None or args.mem_fraction is not None:
        return fraction.value
    written = disk_budget(cfg, quant).checkpoint_bytes
    free = shutil.disk_usage(args.workdir or tempfile.gettempdir()).free
    if written > free:
        raise SystemExit(
            f"{cfg['num_hidden_layers']} layers {quant}: its checkpoints take {written / 2**30:.1f} GiB but "
            f"{args.workdir or tempfile.gettempdir()} has {free / 2**30:.1f} GiB free; pass --workdir on a larger "
            "disk (or /dev/shm when the host memory holds them)"
        )
    return fraction.value


if __name__ == "__main__":
    sys.exit(main())

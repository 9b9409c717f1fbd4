"""docs/measurements/plan_rates.json: derived from this repository's committed measurement JSONs, and read.

`derive_rates` reads each source JSON and records, per figure, the file and field it came from; the result is
committed as docs/measurements/plan_rates.json (a test re-derives it, so the table cannot drift from its sources).
Calibration figures (fixed costs) come from runs named in `CALIBRATION`; `plan --check-measured` checks the others.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from verl_p2p.planning.plan_rates import Rates

MEASUREMENTS = Path(__file__).resolve().parents[2] / "docs" / "measurements"
RATES_FILE = MEASUREMENTS / "plan_rates.json"
# the runs whose fixed costs calibrate the model (never checked as held out)
CALIBRATION = {
    "megatron": ("grpo_h200_resume_tiny_p2p.json", "grpo_h200_save_step3_tiny_p2p.json"),
    "fsdp": ("grpo_h100_one_step_off_tiny_fsdp_p2p.json",),
    "control_plane": ("e2e_h200_sglang0512.json",),
}
TINY_BYTES, TINY_TENSORS = 2886656, 25  # the tiny GRPO shape (recipes/tiny/make_tiny.py MODEL), bf16


def load_rates(path: Path = RATES_FILE) -> Rates:
    return Rates.from_document(json.loads(Path(path).read_text()))


def _read(name: str, root: Path) -> dict:
    return json.loads((root / name).read_text())


def _fig(value: float, source: str, field: str, how: str = "") -> dict:
    return {"value": value, "file": f"docs/measurements/{source}", "field": field, **({"how": how} if how else {})}


def _steady(report: dict, key: str) -> list[float]:
    return [s[key] for s in report["steps"][1:] if isinstance(s.get(key), (int, float))]


def derive_rates(root: Path = MEASUREMENTS) -> dict:
    """Every rate with the file and field it came from (the content of plan_rates.json)."""
    rates: dict[str, dict] = {}
    moon = _read("mooncake_tcp_h200.json", root)
    case = next(c for c in moon["cases"] if (c["src"], c["dst"]) == ("pinned", "gpu"))
    rates["tcp_one_host_gbps"] = _fig(
        case["bytes"] / statistics.median(case["seconds"]) / 1e9, "mooncake_tcp_h200.json",
        "cases[src=pinned,dst=gpu].bytes / median(seconds)", "a push writes from pinned host slots to the GPU",
    )  # fmt: skip
    staging = _read("gpu_staging_h200_512mb.json", root)
    rates["staging_gbps"] = _fig(staging["d2h_pinned_slot_gbps"], "gpu_staging_h200_512mb.json", "d2h_pinned_slot_gbps")
    for key, name, weights in (
        ("convert_gbps", "bench_convert_h200_qwen3_30b_a3b_tp2ep2.json", None),
        ("fp8_convert_gbps", "bench_convert_fp8_h200_qwen3_30b_a3b_tp2ep2_s12.json", "fp8"),
    ):
        runs = _read(name, root)["runs"]
        run = next(r for r in runs if (r["executor"], r["slots"], r.get("weights")) == ("compiled", "gpu", weights))
        where = "executor=compiled,slots=gpu" + (f",weights={weights}" if weights else "")
        rates[key] = _fig(run["convert_gbps"], name, f"runs[{where}].convert_gbps")
    # export: seconds per HF tensor, fitted through two Megatron-Bridge exports (dense and MoE) of similar bytes
    points = []
    for name in ("gpu_export_h200_qwen3_tp1.json", "gpu_export_h200_moe_tp1.json"):
        rank = _read(name, root)["ranks"][0]
        points.append((rank["full_tensors"], statistics.median(rank["full_s"])))
    (n0, s0), (n1, s1) = points
    rates["export_per_tensor_s"] = _fig(
        (s1 - s0) / (n1 - n0), "gpu_export_h200_qwen3_tp1.json + gpu_export_h200_moe_tp1.json",
        "ranks[0].full_s (median) over ranks[0].full_tensors", "slope between the two exports (bytes cost ~nothing)",
    )  # fmt: skip
    # calibration: p2p's steady push of the tiny shape less its predicted byte costs, and verl's timer around it
    meg = [_read(n, root) for n in CALIBRATION["megatron"]]
    tiny_bytes_s = TINY_BYTES / (rates["tcp_one_host_gbps"]["value"] * 1e9)
    tiny_bytes_s += TINY_TENSORS * rates["export_per_tensor_s"]["value"]
    push = statistics.median([p for r in meg for p in _steady(r, "push_s")])
    names = " + ".join(CALIBRATION["megatron"])
    rates["push_fixed_s"] = _fig(
        push - tiny_bytes_s, names, "median(steps[1:].push_s)", "less the tiny shape's wire and export seconds"
    )
    fsdp = [_read(n, root) for n in CALIBRATION["fsdp"]]
    fsdp_push = statistics.median([p for r in fsdp for p in _steady(r, "push_s")])
    rates["push_extra_s_fsdp"] = _fig(
        fsdp_push - push,
        f"{' + '.join(CALIBRATION['fsdp'])} less push_fixed_s",
        "median(steps[1:].push_s)",
        "an FSDP trainer's push adds its full-tensor gathers (get_per_tensor_param) to p2p's fixed push cost",
    )
    for kind, runs in (("megatron", meg), ("fsdp", fsdp)):
        gaps = [s["sync_s"] - s["push_s"] for r in runs for s in r["steps"][1:] if s.get("sync_s") and s.get("push_s")]
        rates[f"verl_overhead_s_{kind}"] = _fig(
            statistics.median(gaps), " + ".join(CALIBRATION[kind]), "median(steps[1:].sync_s - steps[1:].push_s)",
            f"verl's update_weights timer around p2p's push ({kind} trainer): HTTP steps, Ray calls, export start",
        )  # fmt: skip
    e2e = _read(CALIBRATION["control_plane"][0], root)
    syncs = [s for m in e2e["models"].values() for s in m["syncs"][1:] if s.get("outcome") == "ok" and not s["drill"]]
    rates["control_per_engine_s"] = _fig(
        statistics.median(s["phases"]["control_plane"] for s in syncs), CALIBRATION["control_plane"][0],
        "median(models.*.syncs[1:].phases.control_plane)", "abort, begin, bump_version, flush_cache, resume per engine",
    )  # fmt: skip
    first = [m["syncs"][0]["phases"] for m in _read("e2e_h200_sglang0521_qwen3.json", root)["models"].values()]
    rates["first_prepare_s"] = _fig(
        statistics.median(p.get("connect", 0) + p.get("prepare", 0) for p in first), "e2e_h200_sglang0521_qwen3.json",
        "models.*.syncs[0].phases.connect + prepare", "first sync only, before the pause (not checked)",
    )  # fmt: skip
    return {
        "about": "rates `verl-p2p plan` predicts a whole sync with; derived by verl_p2p.cli.plan_rates_file."
        "derive_rates from the files named per figure. Calibration runs (never held out): "
        + "; ".join(f"{k}: {', '.join(v)}" for k, v in CALIBRATION.items()),
        "rates": rates,
    }

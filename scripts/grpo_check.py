"""Checks around the tiny GRPO run on the GPU machine (scripts/gpu_grpo_run.sh runs them beside the recipe).

probe    beside the run: find verl's SGLang server actor (Ray namespace of recipes/tiny_grpo_2gpu.sh), and at every
         new weight version ask the rollout for a greedy completion of fixed input_ids and the checksums of every
         tensor it holds (`weights_checker checksum`); a record counts only when /model_info gives the same version
         before and after and the response carries it too (no sync in between).
fresh    once the trainer's HF export of step STEPS-1 is complete (one step off: the weights the rollout holds
         after the last sync, version STEPS), start a plain SGLang server on it with the rollout's server args, and
         after the run compare its greedy output_ids and checksums with the rollout's for version STEPS.
summary  steps completed, each step's checkpoint_engine/p2p/* metrics (verl's file logger, else its console
         lines, else p2p's own "p2p sync to version N" log lines), the weight versions the rollout went through,
         the first sync's weight check (passed, or skipped on a resumed trainer), the fresh-server comparison,
         and for fully_async the parameter versions its samples carry: one JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# the tiny tokenizer's chat template of PROMPT (tests/test_tiny_recipe.py keeps the two in step)
PROMPT = [{"role": "user", "content": "w90 w190 w290 repeat the word w140"}]
INPUT_IDS = [1, 6, 4, 101, 201, 301, 8, 9, 10, 151, 2, 4, 1, 7, 4]
SAMPLING = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
# the rollout's server args that decide numerics (recipes/tiny_grpo_2gpu.sh, verl's SGLangHttpServer defaults)
SERVER_ARGS = [
    "--dtype", "bfloat16", "--tp-size", "1", "--attention-backend", "triton", "--sampling-backend", "pytorch",
    "--disable-cuda-graph", "--grammar-backend", "none", "--skip-tokenizer-init", "--skip-server-warmup",
    "--load-format", "auto",
]  # fmt: skip
P2P_PREFIX = "checkpoint_engine/p2p/"
SYNC_TIMER = "timing_s/update_weights"  # verl's own timer around every backend's sync
CHECK_PASSED = "check_weight_update_equal: compare passed"


def http(url: str, payload: dict | None = None, timeout: float = 30.0) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def greedy(url: str) -> dict:
    out = http(f"{url}/generate", {"input_ids": INPUT_IDS, "sampling_params": SAMPLING}, timeout=60)
    meta = out.get("meta_info", {})
    return {
        "output_ids": out.get("output_ids"),
        "finish_reason": meta.get("finish_reason"),
        "weight_version": meta.get("weight_version"),
    }


def checksums(url: str) -> dict[str, str] | None:
    """{"tp<rank>:<tensor>": checksum} of every tensor the server holds (None where the route is missing)."""
    try:
        answer = http(f"{url}/weights_checker", {"action": "checksum"}, timeout=120)
    except Exception:
        return None
    out: dict[str, str] = {}
    for rank in answer.get("ranks") or []:
        tp = rank.get("parallelism_info", {}).get("tp_rank", 0)
        out.update({f"tp{tp}:{tensor}": value for tensor, value in rank.get("checksums", {}).items()})
    return out or None


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


# ---- probe -----------------------------------------------------------------------------------------------------


def find_rollout(namespace: str, actor: str, deadline: float, stopped=lambda: False) -> str:
    import ray

    while not stopped():
        try:
            if not ray.is_initialized():
                ray.init(address="auto", namespace=namespace, log_to_driver=False, logging_level="ERROR")
            host, port = ray.get(ray.get_actor(actor).get_server_address.remote(), timeout=10)
            host = f"[{host}]" if ":" in host else host
            return f"http://{host}:{port}"
        except Exception:  # cluster, actor or server not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
    raise RuntimeError("stopped before verl's rollout server was found")


def rollout_version(args, url: str):
    """The weight version the rollout holds now. `sglang`: SGLang's own /model_info weight_version (p2p bumps it
    every sync). `verl`: the `global_steps` verl's server actor records after each update (verl's own engines
    leave SGLang's weight_version at "default")."""
    if args.version_from == "sglang":
        return http(f"{url}/model_info", timeout=5).get("weight_version")
    import ray

    steps = ray.get(ray.get_actor(args.actor).__ray_call__.remote(lambda server: server.global_steps), timeout=5)
    return None if steps is None else str(steps)


def cmd_probe(args) -> int:
    out = Path(args.out)
    state = {"url": None, "records": {}, "errors": []}
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    deadline = time.monotonic() + args.timeout
    write_json(out, state)
    try:
        state["url"] = url = args.url or find_rollout(args.namespace, args.actor, deadline, lambda: stop["now"])
    except Exception as exc:
        state["errors"].append(f"rollout server not found: {exc!r}")
        write_json(out, state)
        return 1
    write_json(out, state)
    if args.version_from == "sglang" and not args.url:  # HTTP from here on: leave the cluster (a driver still
        import ray  # attached when the run's cluster goes away is aborted by Ray, losing the probe's last write)

        ray.shutdown()
    seen = None
    while not stop["now"] and time.monotonic() < deadline:
        try:
            version = rollout_version(args, url)
            if version != seen and version is not None:
                first = greedy(url)
                after = rollout_version(args, url)
                # SGLang's own counter also travels in the response (verl's does not)
                carried = args.version_from != "sglang" or first["weight_version"] == version
                stable = carried and version == after and first["finish_reason"] is not None
                stable = stable and "abort" not in json.dumps(first["finish_reason"])
                if stable:
                    second = greedy(url)
                    first["repeat_equal"] = second["output_ids"] == first["output_ids"]
                    sums = checksums(url)
                    if rollout_version(args, url) != version:
                        continue  # a sync came between: take this version again
                    first["checksums"] = sums
                    first["t"] = time.time()
                    state["records"][str(version)] = first
                    seen = version
                    write_json(out, state)
        except Exception as exc:  # the run ended (server gone) or a sync paused it: try again
            state["errors"] = (state["errors"] + [repr(exc)])[-20:]
        time.sleep(args.poll)
    write_json(out, state)
    return 0


# ---- fresh server ------------------------------------------------------------------------------------------------


def freest_gpu() -> str:
    try:
        rows = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split("\n")
        used = sorted((int(m), i.strip()) for i, m in (r.split(",") for r in rows if r.strip()))
        return used[0][1]
    except Exception:
        return "0"


class HFExport:
    """Where a verl save of `step` puts its HF model, and when it is complete. Megatron: actor/model/huggingface,
    complete once rank 0 wrote its manifest (ckpt_contents.json, written last). FSDP (save_contents 'hf_model'):
    actor/huggingface, complete once the trainer recorded the step in latest_checkpointed_iteration.txt (written
    after every rank's save returned); its config.json alone is written on every save and proves nothing."""

    def __init__(self, ckpts: Path, step: int) -> None:
        self.ckpts, self.step = ckpts, step

    def actor(self) -> Path:
        return self.ckpts / f"global_step_{self.step}" / "actor"

    def megatron(self) -> bool:
        return (self.actor() / "model").is_dir() or (self.actor() / "ckpt_contents.json").exists()

    def hf_dir(self) -> Path:
        return self.actor() / "model" / "huggingface" if self.megatron() else self.actor() / "huggingface"

    def waits_for(self) -> str:
        if self.megatron():
            return f"manifest {self.actor() / 'ckpt_contents.json'}"
        latest = self.ckpts / "latest_checkpointed_iteration.txt"
        return f"step {self.step} in {latest} and safetensors in {self.hf_dir()}"

    def complete(self) -> bool:
        if not (self.hf_dir() / "config.json").exists():
            return False
        if self.megatron():
            return (self.actor() / "ckpt_contents.json").exists()
        latest = self.ckpts / "latest_checkpointed_iteration.txt"
        try:
            saved = int(latest.read_text().strip())
        except (OSError, ValueError):
            return False
        return saved >= self.step and any(self.hf_dir().glob("*.safetensors"))


def cmd_fresh(args) -> int:
    out = Path(args.out)
    deadline = time.monotonic() + args.timeout
    export, done = HFExport(Path(args.ckpts), args.step), Path(args.done_file)
    while not export.complete() and not done.exists() and time.monotonic() < deadline:
        time.sleep(1)
    hf_dir = export.hf_dir()
    result: dict = {"hf_dir": str(hf_dir), "version": str(args.version), "equal": False}
    if not export.complete():
        result["error"] = f"no complete HF export at {hf_dir} ({export.waits_for()})"
        write_json(out, result)
        return 1
    gpu = freest_gpu()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    launcher = json.loads(args.server_cmd) if args.server_cmd else [sys.executable, "-m", "sglang.launch_server"]
    cmd = [*launcher, "--model-path", str(hf_dir), "--host", "127.0.0.1", "--port", str(args.port),
           "--mem-fraction-static", str(args.mem_fraction), *SERVER_ARGS]  # fmt: skip
    result.update(gpu=gpu, command=cmd, started_at=time.time())
    log = open(args.log, "w")  # noqa: SIM115 - the server writes it until killed
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    try:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"fresh SGLang server exited with {server.returncode} (see {args.log})")
            try:
                http(f"{url}/model_info", timeout=5)
                break
            except Exception:
                time.sleep(2)
        else:
            raise TimeoutError("fresh SGLang server not healthy in time")
        result["healthy_after_s"] = round(time.time() - result["started_at"], 1)
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(1)
        fresh = greedy(url)
        fresh["repeat_equal"] = greedy(url)["output_ids"] == fresh["output_ids"]
        fresh_sums = checksums(url)
        result["fresh"] = fresh
        probe = json.loads(Path(args.probe).read_text()) if Path(args.probe).exists() else {}
        rollout = probe.get("records", {}).get(str(args.version))
        result["rollout"] = rollout
        if rollout is None:
            result["error"] = f"the probe recorded no rollout output at weight version {args.version}"
        else:
            rollout_sums = rollout.pop("checksums", None)
            result["checksums_compared"] = len(fresh_sums or {})
            differ = sorted(k for k in set(fresh_sums or {}) | set(rollout_sums or {})
                            if (fresh_sums or {}).get(k) != (rollout_sums or {}).get(k))  # fmt: skip
            result["checksums_equal"] = bool(fresh_sums) and not differ
            result["checksums_differ"] = differ[:20]
            result["greedy_equal"] = rollout["output_ids"] == fresh["output_ids"] and bool(fresh["output_ids"])
            result["equal"] = result["greedy_equal"] and result["checksums_equal"]
    except Exception as exc:
        result["error"] = repr(exc)
    finally:
        if server.poll() is None:  # the server's own session: it and its scheduler/detokenizer processes
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=10)
        log.close()
        write_json(out, result)
    return 0 if result["equal"] else 1


# ---- summary -----------------------------------------------------------------------------------------------------

_CONSOLE = re.compile(r"step:(\d+) - (.*)$")


def step_metrics(metrics_jsonl: Path, log_text: str) -> tuple[dict[int, dict], str]:
    steps: dict[int, dict] = {}
    if metrics_jsonl.exists():
        for line in metrics_jsonl.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            steps.setdefault(int(row["step"]), {}).update(row.get("data", {}))
        if steps:
            return steps, str(metrics_jsonl)
    for line in log_text.splitlines():
        m = _CONSOLE.search(line)
        if not m:
            continue
        row = steps.setdefault(int(m.group(1)), {})
        for part in m.group(2).split(" - "):
            key, sep, value = part.rpartition(":")
            if sep:
                try:
                    row[key.strip()] = float(value)
                except ValueError:
                    pass
    return steps, "console log"


_P2P_SYNC_LINE = re.compile(r"p2p sync to version (\S+): (\{.*\})")
CHECK_SKIPPED = "check_weight_update_equal skipped"


def p2p_sync_lines(log_text: str) -> dict[str, dict]:
    """p2p's own per-sync log line (backend/engine.py), keyed by version: the figures where verl drops them."""
    out: dict[str, dict] = {}
    for line in log_text.splitlines():
        m = _P2P_SYNC_LINE.search(line)
        if m:
            try:
                out[m.group(1)] = json.loads(m.group(2))
            except ValueError:
                continue
    return out


def weight_check(check_lines: list[str], expect: str) -> dict:
    """The first sync's check: `passed` (compare passed, nothing failed) or `skipped` (a resumed trainer); `none`
    expected of verl's own engines, which have no such check (no line at all)."""
    failed = [ln for ln in check_lines if "failed" in ln or "WeightCheckError" in ln]
    passed = any(CHECK_PASSED in ln for ln in check_lines) and not failed
    skipped = any(CHECK_SKIPPED in ln for ln in check_lines) and not failed
    verdict = "passed" if passed else "skipped" if skipped else "failed" if failed else "missing"
    ok = verdict == ("missing" if expect == "none" else expect)
    return {"expected": expect, "verdict": verdict, "ok": ok, "log_lines": check_lines[:10]}


def async_versions(trained: dict[int, dict]) -> dict:
    """fully_async: the parameter version each training step's samples were generated with (verl's own counters),
    and whether requests were in flight across syncs (partial rollouts)."""
    rows = {
        str(s): {
            k: m[k]
            for k in sorted(m)
            if k.startswith(("fully_async/count/current_param_version", "fully_async/partial/"))
        }
        for s, m in sorted(trained.items())
    }
    current = [m.get("fully_async/count/current_param_version") for _, m in sorted(trained.items())]
    known = [v for v in current if v is not None]
    partial = [m.get("fully_async/partial/total_partial_num", 0.0) for m in trained.values()]
    return {
        "per_step": rows,
        "versions_non_decreasing": bool(known) and all(a <= b for a, b in zip(known, known[1:], strict=False)),
        "partial_rollouts": float(sum(partial)),
    }


def version_order(version: str) -> tuple:
    """Sort key of the rollout's weight versions: SGLang's start-up "default" first, then the syncs' numbers."""
    if version == "default":
        return (0, 0, "")
    return (1, int(version), "") if version.isdigit() else (2, 0, version)


CONTROL = "control"  # recipes/learn/control_engine.py: the negative control's engine never writes the rollout


def fresh_verdict(compare: dict, backend: str) -> tuple[str, bool]:
    """(what the fresh-server comparison must show, whether it does). Every engine that syncs: the rollout equals a
    fresh server on the trainer's export. The negative control: its rollout kept its first weights, so the two
    must differ (a compared set of checksums, not all equal); equal would mean the weights moved without a sync."""
    if backend != CONTROL:
        return "equal", bool(compare.get("equal"))
    compared = bool(compare.get("checksums_compared")) and "error" not in compare
    return "differ", compared and compare.get("checksums_equal") is False


def cmd_summary(args) -> int:
    log_text = Path(args.log).read_text(errors="replace") if Path(args.log).exists() else ""
    steps, source = step_metrics(Path(args.metrics), log_text)
    trained = {s: m for s, m in steps.items() if "training/global_step" in m}
    per_step = {s: {k: v for k, v in sorted(m.items()) if k.startswith(P2P_PREFIX)} for s, m in sorted(trained.items())}
    syncs = p2p_sync_lines(log_text)
    # verl_p2p's checker lines ("check_weight_update_equal: <what happened>") and any WeightCheckError
    marks = ("check_weight_update_equal: ", CHECK_SKIPPED, "WeightCheckError")
    check_lines = [ln.strip()[:400] for ln in log_text.splitlines() if any(m in ln for m in marks)]
    compare = json.loads(Path(args.compare).read_text()) if Path(args.compare).exists() else {}
    probe = json.loads(Path(args.probe).read_text()) if Path(args.probe).exists() else {}
    records = probe.get("records", {})
    probed = [v for v, _ in sorted(records.items(), key=lambda kv: kv[1].get("t", 0))]
    versions_in_order = probed == sorted(probed, key=version_order)
    summary = {
        "mode": args.mode,
        "backend": args.backend,
        "run_exit_code": args.rc,
        "steps_expected": args.steps,
        "steps_completed": max(trained, default=0),
        "metrics_source": source,
        "p2p_metrics": {str(s): m for s, m in per_step.items()},
        "p2p_sync_log": syncs,
        "first_sync_weight_check": weight_check(check_lines, args.expect_check),
        "greedy_vs_fresh_server": compare,
        "rollout_versions_probed": probed,
        "rollout_versions_in_order": versions_in_order,
        "save_hook_lines": sum("transfer buffers released for save_checkpoint" in ln for ln in log_text.splitlines()),
    }
    if args.backend != "p2p":  # verl's own engines: verl's sync timer every step; no p2p metrics, no p2p check
        every = bool(trained) and all(SYNC_TIMER in m for m in trained.values())
        versions_ok = True
    elif args.mode == "fully_async":
        summary["fully_async"] = async_versions(trained)
        summary["p2p_syncs"] = len(syncs)
        every = len(syncs) >= args.steps
        # and requests were in flight when syncs started (verl's partial-rollout count), what the run is meant to show
        versions = summary["fully_async"]
        versions_ok = versions["versions_non_decreasing"] and versions["partial_rollouts"] > 0
    else:
        every = bool(per_step) and all(per_step.values())
        versions_ok = True
    summary["p2p_metrics_every_step"] = every
    summary["fresh_server_expected"], fresh_ok = fresh_verdict(compare, args.backend)
    final = str(args.final_version) if args.final_version is not None else None
    summary["final_version_probed"] = final is None or (bool(probed) and probed[-1] == final)
    summary["ok"] = bool(
        args.rc == 0
        and summary["steps_completed"] >= args.steps
        and every
        and versions_ok
        and versions_in_order
        and summary["final_version_probed"]
        and summary["first_sync_weight_check"]["ok"]
        and fresh_ok
    )
    write_json(Path(args.out), summary)
    print(json.dumps({k: summary[k] for k in ("ok", "steps_completed", "p2p_metrics_every_step")}))
    return 0 if summary["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--namespace", default="verl_p2p_tiny")
    p.add_argument("--actor", default="sglang_server_0_0")
    p.add_argument("--url", help="the rollout's address, instead of finding verl's server actor through Ray")
    p.add_argument("--out", required=True)
    p.add_argument("--poll", type=float, default=0.2)
    p.add_argument("--version-from", choices=("sglang", "verl"), default="sglang",
                   help="sglang: SGLang's weight_version (p2p); verl: verl's server actor's global_steps (verl's "
                   "own engines)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600)
    f = sub.add_parser("fresh")
    f.add_argument("--ckpts", required=True)
    f.add_argument("--step", type=int, required=True)
    f.add_argument("--version", required=True)
    f.add_argument("--probe", required=True)
    f.add_argument("--done-file", required=True)
    f.add_argument("--out", required=True)
    f.add_argument("--log", required=True)
    f.add_argument("--port", type=int, default=31000)
    f.add_argument("--mem-fraction", type=float, default=0.15)
    f.add_argument("--timeout", type=float, default=560)
    f.add_argument("--server-cmd", help="JSON list launching the server (default: python -m sglang.launch_server)")
    s = sub.add_parser("summary")
    s.add_argument("--log", required=True)
    s.add_argument("--metrics", required=True)
    s.add_argument("--probe", required=True)
    s.add_argument("--compare", required=True)
    s.add_argument("--steps", type=int, required=True)
    s.add_argument("--rc", type=int, required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--mode", choices=("one_step_off", "fully_async"), default="one_step_off")
    s.add_argument("--expect-check", choices=("passed", "skipped", "none"), default="passed")
    s.add_argument(
        "--backend",
        default="p2p",
        help="p2p, verl's own engine (mooncake, nixl) or the negative "
        "control (control): no p2p metrics; the control's rollout must differ from the fresh server",
    )
    s.add_argument("--final-version", help="the weight version the rollout must end at (one_step_off: STEPS)")
    args = parser.parse_args(argv)
    return {"probe": cmd_probe, "fresh": cmd_fresh, "summary": cmd_summary}[args.cmd](args)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # the probe is a second Ray driver of a cluster that is gone by now: skip Ray's exit-time disconnect
    os._exit(code)

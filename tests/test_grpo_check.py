"""scripts/grpo_check.py, the checks around the GPU run: `summary` reads verl's own logs, and a run that missed a
step's p2p metrics, failed the weight check or differs from the fresh server is not ok; `probe` keeps only greedy
outputs whose weight version held still; `fresh` starts a server on the export and compares (a stand-in server
here: tests/support/fake_generate_server.py)."""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("grpo_check", ROOT / "scripts" / "grpo_check.py")
grpo_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grpo_check)

CHECKED = (
    "(OneStepTaskRunner pid=7) INFO:verl_p2p.rollout.checker:check_weight_update_equal: compare passed on 1 replica(s)"
)


def console(step: int, p2p: bool = True) -> str:
    metrics = f"training/global_step:{step} - training/epoch:0 - actor/pg_loss:-0.01"
    if p2p:
        metrics += f" - checkpoint_engine/p2p/bytes:2886144.0 - checkpoint_engine/p2p/seconds/total:0.{step}"
    return f"(OneStepTaskRunner pid=7) step:{step} - {metrics}"


def run(tmp_path: Path, lines: list[str], equal: bool = True, rc: int = 0, jsonl: bool = False, *extra: str) -> dict:
    (tmp_path / "run.log").write_text("\n".join(lines) + "\n")
    if jsonl:
        rows = [
            {"step": s, "data": {"training/global_step": s, "checkpoint_engine/p2p/bytes": 1.0}} for s in (1, 2, 3, 4)
        ]
        (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "compare.json").write_text(json.dumps({"equal": equal, "version": "4"}))
    (tmp_path / "probe.json").write_text(json.dumps({"records": {"0": {}, "4": {}, "10": {}}}))
    args = [
        "summary", "--log", str(tmp_path / "run.log"), "--metrics", str(tmp_path / "metrics.jsonl"),
        "--probe", str(tmp_path / "probe.json"), "--compare", str(tmp_path / "compare.json"),
        "--steps", "4", "--rc", str(rc), "--out", str(tmp_path / "summary.json"), *extra,
    ]  # fmt: skip
    grpo_check.main(args)
    return json.loads((tmp_path / "summary.json").read_text())


def test_complete_run_is_ok_with_every_steps_p2p_metrics(tmp_path):
    s = run(
        tmp_path, ["step:0 - val-core/tiny_repeat/reward/mean@1:0.01", CHECKED] + [console(i) for i in (1, 2, 3, 4)]
    )
    assert s["ok"] and s["steps_completed"] == 4 and s["metrics_source"] == "console log"
    assert s["p2p_metrics"]["3"] == {
        "checkpoint_engine/p2p/bytes": 2886144.0,
        "checkpoint_engine/p2p/seconds/total": 0.3,
    }
    assert s["first_sync_weight_check"]["verdict"] == "passed" and s["rollout_versions_probed"] == ["0", "4", "10"]


def test_file_logger_is_preferred_over_console_lines(tmp_path):
    s = run(tmp_path, [CHECKED], jsonl=True)
    assert s["metrics_source"].endswith("metrics.jsonl") and s["ok"]


@pytest.mark.parametrize(
    "lines, equal, rc",
    [
        ([CHECKED] + [console(i, p2p=i != 2) for i in (1, 2, 3, 4)], True, 0),  # a step without sync metrics
        ([console(i) for i in (1, 2, 3, 4)], True, 0),  # no verdict of the weight check
        ([CHECKED, "WeightCheckError: check_weight_update_equal after the first sync: compare failed"], True, 1),
        ([CHECKED] + [console(i) for i in (1, 2, 3)], True, 0),  # stopped early
        ([CHECKED] + [console(i) for i in (1, 2, 3, 4)], False, 0),  # rollout differs from the fresh server
    ],
    ids=["missing-metrics", "no-check", "check-failed", "short", "greedy-differs"],
)
def test_incomplete_runs_are_not_ok(tmp_path, lines, equal, rc):
    assert run(tmp_path, lines, equal=equal, rc=rc)["ok"] is False


# ---- probe and fresh, against a stand-in of SGLang's /model_info and /generate ----------------------------------

SCRIPT = str(ROOT / "scripts" / "grpo_check.py")
FAKE = str(ROOT / "tests" / "support" / "fake_generate_server.py")
fake = importlib.util.spec_from_file_location("fake_generate_server", FAKE)
fake_server = importlib.util.module_from_spec(fake)
fake.loader.exec_module(fake_server)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def records(path: Path) -> dict:
    try:
        return json.loads(path.read_text()).get("records", {})
    except (OSError, ValueError):
        return {}


def expected(version: str) -> list[int]:
    return fake_server.output_ids(version, grpo_check.INPUT_IDS, grpo_check.SAMPLING["max_new_tokens"])


def test_probe_records_the_rollouts_greedy_output_at_each_weight_version(tmp_path):
    version, port, out = tmp_path / "version", free_port(), tmp_path / "probe.json"
    version.write_text("0")
    server = subprocess.Popen([sys.executable, FAKE, "--port", str(port), "--version-file", str(version)])
    probe = subprocess.Popen(
        [sys.executable, SCRIPT, "probe", "--url", f"http://127.0.0.1:{port}", "--out", str(out), "--poll", "0.05"]
    )
    try:
        wait_for(lambda: "0" in records(out))
        version.write_text("3")
        wait_for(lambda: "3" in records(out))
        probe.send_signal(signal.SIGTERM)
        assert probe.wait(timeout=30) == 0
    finally:
        for proc in (probe, server):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
    got = records(out)
    assert set(got) == {"0", "3"}
    for v in ("0", "3"):
        assert got[v]["output_ids"] == expected(v) and got[v]["repeat_equal"] and got[v]["weight_version"] == v


def write_export(ckpts: Path, trainer: str, complete: bool = True) -> Path:
    """A verl save of step 3 as each trainer lays it out: Megatron's HF export beside its manifest; FSDP's HF model
    (save_contents 'hf_model') whose config.json verl writes on every save, the weights only when asked."""
    actor = ckpts / "global_step_3" / "actor"
    hf = actor / "model" / "huggingface" if trainer == "megatron" else actor / "huggingface"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    if trainer == "megatron":
        (actor / "model" / "dist.pt").write_text("")
        if complete:
            (actor / "ckpt_contents.json").write_text("{}")
    elif complete:
        (hf / "model.safetensors").write_text("")
        (ckpts / "latest_checkpointed_iteration.txt").write_text("3")
    return hf


@pytest.mark.parametrize("trainer", ["megatron", "fsdp"])
@pytest.mark.parametrize("served_version, equal", [("4", True), ("5", False)], ids=["same-weights", "different"])
def test_fresh_server_on_the_export_is_compared_with_the_last_rollout_version(tmp_path, served_version, equal, trainer):
    ckpts = tmp_path / "ckpts"
    hf = write_export(ckpts, trainer)
    record = {"output_ids": expected("4"), "checksums": {f"tp0:{k}": v for k, v in fake_server.checksums("4").items()}}
    (tmp_path / "probe.json").write_text(json.dumps({"records": {"4": record}}))
    (tmp_path / "done").touch()
    version, port = tmp_path / "version", free_port()
    version.write_text(served_version)
    launcher = json.dumps([sys.executable, FAKE, "--version-file", str(version)])
    args = [
        sys.executable, SCRIPT, "fresh", "--ckpts", str(ckpts), "--step", "3", "--version", "4",
        "--probe", str(tmp_path / "probe.json"), "--done-file", str(tmp_path / "done"),
        "--out", str(tmp_path / "compare.json"), "--log", str(tmp_path / "fresh.log"), "--port", str(port),
        "--timeout", "60", "--server-cmd", launcher,
    ]  # fmt: skip
    rc = subprocess.run(args, timeout=90).returncode
    compare = json.loads((tmp_path / "compare.json").read_text())
    assert compare["equal"] is equal and rc == (0 if equal else 1)
    assert (
        compare["checksums_equal"] is equal and compare["greedy_equal"] is equal and compare["checksums_compared"] == 2
    )
    assert compare["fresh"]["output_ids"] == expected(served_version) and compare["hf_dir"] == str(hf)
    with socket.socket() as s:  # the server (its own process group) is gone
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_config_dumps_and_override_lists_are_no_verdict(tmp_path):
    noise = [
        "(OneStepTaskRunner pid=7)      'check_weight_update_equal': True,",
        "Error executing job with overrides: ['...p2p.check_weight_update_equal=true']",
    ]
    s = run(tmp_path, noise + [console(i) for i in (1, 2, 3, 4)])
    check = s["first_sync_weight_check"]
    assert check["verdict"] == "missing" and not check["ok"] and check["log_lines"] == []


SKIPPED = (
    "(OneStepTaskRunner pid=7) INFO:verl_p2p.rollout.checker:check_weight_update_equal skipped: the trainer resumed "
    "from a checkpoint, so its weights differ from the rollout's initial checkpoint by design"
)


def test_a_resumed_run_expects_the_check_skipped(tmp_path):
    lines = [SKIPPED] + [console(i) for i in (1, 2, 3, 4)]
    assert run(tmp_path, lines, True, 0, False, "--expect-check", "skipped")["ok"]
    assert not run(tmp_path, lines)["ok"]  # a fresh run whose check was skipped is not ok
    assert not run(tmp_path, [CHECKED] + lines[1:], True, 0, False, "--expect-check", "skipped")["ok"]


def test_the_rollout_must_end_at_the_final_version(tmp_path):
    lines = [CHECKED] + [console(i) for i in (1, 2, 3, 4)]
    assert run(tmp_path, lines, True, 0, False, "--final-version", "10")["final_version_probed"]
    s = run(tmp_path, lines, True, 0, False, "--final-version", "4")
    assert not s["final_version_probed"] and not s["ok"]


def sync_line(version: int) -> str:
    body = json.dumps({"checkpoint_engine/p2p/bytes": 1000.0, "checkpoint_engine/p2p/seconds/total": 0.1})
    return f"(FullyAsyncTrainer pid=9) INFO:verl_p2p.backend.engine:p2p sync to version {version}: {body}"


def async_step(step: int, version: int, partial: float) -> str:
    metrics = (
        f"training/global_step:{step} - fully_async/count/current_param_version:{version}"
        f" - fully_async/partial/total_partial_num:{partial}"
    )
    return f"(FullyAsyncTrainer pid=9) step:{step} - {metrics}"


def test_fully_async_reads_p2p_sync_lines_and_the_samples_versions(tmp_path):
    lines = [CHECKED] + [sync_line(v) for v in range(5)] + [async_step(s, s, 2.0 * (s % 2)) for s in (1, 2, 3, 4)]
    s = run(tmp_path, lines, True, 0, False, "--mode", "fully_async")
    assert s["ok"] and s["p2p_syncs"] == 5 and s["p2p_sync_log"]["3"]["checkpoint_engine/p2p/bytes"] == 1000.0
    assert s["fully_async"]["versions_non_decreasing"] and s["fully_async"]["partial_rollouts"] == 4.0
    back = [CHECKED] + [sync_line(v) for v in range(5)] + [async_step(s, 4 - s, 0.0) for s in (1, 2, 3, 4)]
    assert not run(tmp_path, back, True, 0, False, "--mode", "fully_async")["ok"]  # versions going back
    few = [CHECKED] + [sync_line(v) for v in range(2)] + [async_step(s, s, 0.0) for s in (1, 2, 3, 4)]
    assert not run(tmp_path, few, True, 0, False, "--mode", "fully_async")["ok"]  # fewer syncs than steps
    # no request in flight at any sync (the H200 run with 32-token responses): not what the run must show
    idle = [CHECKED] + [sync_line(v) for v in range(5)] + [async_step(s, s, 0.0) for s in (1, 2, 3, 4)]
    s = run(tmp_path, idle, True, 0, False, "--mode", "fully_async")
    assert not s["ok"] and s["fully_async"]["partial_rollouts"] == 0.0 and s["fully_async"]["versions_non_decreasing"]


def verl_engine_step(step: int, timed: bool = True) -> str:
    metrics = f"training/global_step:{step} - actor/pg_loss:-0.01"
    if timed:
        metrics += f" - timing_s/update_weights:1.{step}"
    return f"(OneStepTaskRunner pid=7) step:{step} - {metrics}"


def test_verls_own_engine_needs_its_sync_timer_every_step_and_no_p2p_check(tmp_path):
    """BACKEND=mooncake|nixl: no p2p metrics and no p2p weight check exist; verl's own timer must be there."""
    mooncake = ("--backend", "mooncake", "--expect-check", "none")
    lines = [verl_engine_step(i) for i in (1, 2, 3, 4)]
    s = run(tmp_path, lines, True, 0, False, *mooncake)
    assert s["ok"] and s["backend"] == "mooncake" and s["first_sync_weight_check"]["verdict"] == "missing"
    assert not run(tmp_path, lines, True, 0, False)["ok"]  # the same log read as a p2p run: no p2p metrics
    untimed = [verl_engine_step(i, timed=i != 3) for i in (1, 2, 3, 4)]
    assert not run(tmp_path, untimed, True, 0, False, *mooncake)["ok"]  # a step without a sync
    assert not run(tmp_path, [CHECKED] + lines, True, 0, False, *mooncake)["ok"]  # a p2p check line: wrong engine
    assert not run(tmp_path, lines, False, 0, False, *mooncake)["ok"]  # rollout differs from the fresh server


VERL_VERSION_PROBE = """
import argparse, importlib.util, json, sys
import ray
spec = importlib.util.spec_from_file_location("grpo_check", sys.argv[1])
grpo_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grpo_check)

@ray.remote
class Server:  # the two members of verl's SGLangHttpServer the probe relies on
    def __init__(self):
        self.global_steps = None

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

ray.init(num_cpus=1, include_dashboard=False, namespace="verl_p2p_tiny", logging_level="ERROR")
server = Server.options(name="sglang_server_0_0").remote()
args = argparse.Namespace(version_from="verl", actor="sglang_server_0_0")
before = grpo_check.rollout_version(args, "http://unused")
ray.get(server.set_global_steps.remote(3))
print(json.dumps([before, grpo_check.rollout_version(args, "http://unused")]))
ray.shutdown()
"""


def test_probe_reads_verls_version_from_the_server_actor_for_verls_own_engines():
    """verl's own engines leave SGLang's weight_version at "default": the probe reads the `global_steps` verl's
    server actor records after each update (a real Ray actor with verl's attribute and setter), in its own
    process (a Ray cluster started and shut down inside the test process breaks the next test's `ray.init`)."""
    proc = subprocess.run(
        [sys.executable, "-c", VERL_VERSION_PROBE, SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [None, "3"]  # before the first sync, then verl's


@pytest.mark.parametrize(
    "versions, in_order",
    [(["default", "0", "1", "2", "10"], True), (["default", "3", "2"], False), (["1", "default"], False)],
)
def test_sglangs_start_up_version_default_comes_before_every_sync(tmp_path, versions, in_order):
    """The probe sees SGLang's own "default" before the first sync (the H200 save/resume runs): it is first in
    order, not sorted after the numbers as a longer string."""
    lines = [CHECKED] + [console(i) for i in (1, 2, 3, 4)]
    run(tmp_path, lines)  # writes the other inputs
    records = {v: {"t": float(i)} for i, v in enumerate(versions)}
    (tmp_path / "probe.json").write_text(json.dumps({"records": records}))
    args = [
        "summary", "--log", str(tmp_path / "run.log"), "--metrics", str(tmp_path / "metrics.jsonl"),
        "--probe", str(tmp_path / "probe.json"), "--compare", str(tmp_path / "compare.json"),
        "--steps", "4", "--rc", "0", "--out", str(tmp_path / "summary.json"),
    ]  # fmt: skip
    grpo_check.main(args)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["rollout_versions_in_order"] is in_order and s["ok"] is in_order


@pytest.mark.parametrize("trainer", ["megatron", "fsdp"])
def test_an_incomplete_export_is_named_and_no_server_starts(tmp_path, trainer):
    """FSDP writes config.json into actor/huggingface on every save: without the weights the export is not there
    (the FSDP run of 316189d looked under Megatron's path and said 'no complete HF export')."""
    ckpts = tmp_path / "ckpts"
    hf = write_export(ckpts, trainer, complete=False)
    (tmp_path / "done").touch()
    args = [
        sys.executable, SCRIPT, "fresh", "--ckpts", str(ckpts), "--step", "3", "--version", "4",
        "--probe", str(tmp_path / "probe.json"), "--done-file", str(tmp_path / "done"),
        "--out", str(tmp_path / "compare.json"), "--log", str(tmp_path / "fresh.log"), "--timeout", "5",
        "--server-cmd", json.dumps(["false"]),
    ]  # fmt: skip
    assert subprocess.run(args, timeout=60).returncode == 1
    compare = json.loads((tmp_path / "compare.json").read_text())
    assert compare["hf_dir"] == str(hf) and "no complete HF export" in compare["error"]
    assert not (tmp_path / "fresh.log").exists()

"""scripts/gpu_verl_replica.py: the one-GPU run of verl's real SGLang replica, synced through verl's managers.

On a CPU host: the configuration the script hands verl (the RolloutConfig of a standalone SGLang replica, the
checkpoint-engine section, the p2p server args that verl_p2p's replica wrapper turns into base + replica rank), the
checks it decides with, and the whole flow with `--rollout loopback` (the CPU stand-in rollout behind tests/support's
stand-in replica, the trainer's Megatron model on the CPU, verl's real managers, Ray, registry and workers).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_verl_replica.py"
spec = importlib.util.spec_from_file_location("gpu_verl_replica", SCRIPT)
script = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = script  # its dataclasses look their module up
spec.loader.exec_module(script)


def test_defaults_are_the_h200_run():
    args = script.parse_args(["--out", "/tmp/x.json"])
    assert args.rollout == "sglang" and args.dtype == "bfloat16"
    assert args.phases == ["stock", "p2p_manager"]
    assert args.replica_rank == 1  # > 0: the live server's port shows the per-replica offset
    assert args.deadline < 560  # the lead's `timeout 560`: the report is complete before it fires
    loopback = script.parse_args(["--rollout", "loopback"])
    assert loopback.dtype == "float32"
    with pytest.raises(SystemExit):
        script.parse_args(["--phases", "stock,nope"])


def test_rollout_config_is_a_standalone_sglang_replica_with_p2p_server_args():
    from verl_p2p.config import P2PConfig
    from verl_p2p.rollout.launch import BOOTSTRAP_PORT, MEMORY_SAVER, SEED_FLAG, apply_to_replica

    args = script.parse_args(["--gpu-memory-utilization", "0.25", "--bootstrap-port", "27000"])
    options = script.p2p_options(args, "10.0.0.7")
    assert P2PConfig.from_mapping(options).check_weight_update_equal is True
    ce = script.checkpoint_engine(options)
    assert ce["backend"] == "verl_p2p" and ce["engine_kwargs"]["verl_p2p"]["hostname"] == "10.0.0.7"
    sglang = script.sglang_engine_kwargs(args, args.bootstrap_port)
    config = script.rollout_config(args, ce, sglang)
    assert (config.name, config.tensor_model_parallel_size, config.data_parallel_size) == ("sglang", 1, 1)
    assert config.gpu_memory_utilization == 0.25 and config.load_format == "auto" and config.dtype == "bfloat16"
    assert config.checkpoint_engine.backend == "verl_p2p"
    kwargs = config.engine_kwargs["sglang"]
    assert kwargs[SEED_FLAG] is True and kwargs[MEMORY_SAVER] is False and kwargs[BOOTSTRAP_PORT] == 27000
    assert kwargs["attention_backend"] == "triton" and kwargs["sampling_backend"] == "pytorch"
    assert kwargs["disable_cuda_graph"] is True and kwargs["grammar_backend"] == "none"

    # what P2PSGLangReplica.launch_servers does with it (the product function, on a replica-shaped object)
    class Replica:
        replica_rank = 1
        is_reward_model = is_teacher_model = False
        rollout_mode = type("Mode", (), {"value": "standalone"})()

    replica = Replica()
    replica.config = config
    apply_to_replica(replica)
    assert replica.config.engine_kwargs["sglang"][BOOTSTRAP_PORT] == 27001
    assert config.engine_kwargs["sglang"][BOOTSTRAP_PORT] == 27000  # the shared config is left alone


def test_checksum_rules_tell_equal_changed_and_missing():
    a = {"tp0:w": "1", "tp0:rotary.cos_sin_cache": "9", "tp0:v": "2"}
    assert script.written_keys(a) == ["tp0:v", "tp0:w"]
    assert script.compare_checksums(dict(a), a) == (True, "3 tensors equal")
    ok, detail = script.compare_checksums({**a, "tp0:w": "x"}, a)
    assert not ok and "tp0:w" in detail
    ok, detail = script.compare_checksums({"tp0:w": "1"}, a)
    assert not ok and "missing" in detail


def test_a_failed_check_or_a_skipped_step_fails_the_run(tmp_path):
    args = script.parse_args(["--out", str(tmp_path / "r.json")])
    report = script.Report(args.out, args)
    report.add(script.Step("a", outcome="ok")).check("fine", True)
    assert report.ok
    report.add(script.Step("b", outcome="ok")).check("broken", False, "why")
    report.write()
    written = json.loads(args.out.read_text())
    assert written["ok"] is False and written["steps"][1]["checks"][0]["detail"] == "why"
    assert "x broken: why" in report.summary()
    skipped = script.Report(args.out, args)
    skipped.add(script.Step("c", outcome="skipped"))
    assert not skipped.ok


def test_a_hung_step_times_out():
    with pytest.raises(script.StepTimeout):
        script.call_with_timeout(__import__("time").sleep, 1.0, 5)


def test_checkpoint_in_float32(tmp_path):
    import torch
    from safetensors.torch import load_file

    path = script.write_checkpoint(tmp_path, "float32")
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "float32"
    assert {t.dtype for t in load_file(path / "model.safetensors").values()} == {torch.float32}
    assert (path / "tokenizer.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_whole_flow_with_the_loopback_rollout(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MC_LOG_LEVEL": "ERROR"}
    command = [sys.executable, str(SCRIPT), "--rollout", "loopback", "--out", str(out), "--workdir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=560, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"]
    steps = {s["name"]: s for s in report["steps"]}
    syncs = [f"{phase}/sync{g}_x{f:g}" for phase in ("stock", "p2p_manager") for g, f in script.SYNCS]
    assert all(steps[name]["outcome"] == "ok" for name in syncs)
    checks = {name: {c["name"]: c["ok"] for c in steps[name]["checks"]} for name in steps}
    for phase in ("stock", "p2p_manager"):
        assert checks[f"{phase}/sync0_x1"] == {
            "p2p_metrics": True,
            "weight_version": True,
            "verl_set_global_steps": True,
            "check_weight_update_equal_ran": True,
            "checksums_equal_rollouts_own_load": True,
        }
        assert checks[f"{phase}/sync1_x2"]["every_weight_changed"] is True
        assert checks[f"{phase}/sync2_x1"]["checksums_equal_rollouts_own_load"] is True
        metrics = steps[f"{phase}/sync1_x2"]["info"]["metrics"]
        assert metrics["checkpoint_engine/p2p/bytes"] > 0 and metrics["checkpoint_engine/p2p/sources"] == 1.0
    assert "checkpoint_engine/p2p/phase/push_s" in steps["p2p_manager/sync0_x1"]["info"]["metrics"]
    assert checks["cross_manager"] == {"x2_checksums_equal_across_managers": True}
    assert checks["server_args"]["registry_sglang_loader_is_p2p_wrapper"] is True
    assert steps["replica_and_trainer"]["info"]["trainer"]["engine"].endswith("transformer_impl.MegatronEngine")

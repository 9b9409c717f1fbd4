"""Each guard produces its message: trainer modes that replace p2p with naive, SGLang server args p2p needs
(config and live), the per-replica launch args, bad p2p options; and the Hydra callback stops a real run."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from support.compose import CONF, OVERLAY, ROOT, compose_config
from verl.workers.config import CheckpointEngineConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode

from verl_p2p.backend.guards import MAIN_PPO, check_config, config_problems, entry_of, warn_hybrid_actor
from verl_p2p.backend.hydra_callback import P2PGuardCallback
from verl_p2p.errors import P2PConfigError
from verl_p2p.rollout import launch
from verl_p2p.rollout.launch import BOOTSTRAP_PORT, MEMORY_SAVER, SEED_FLAG

MAIN = "verl.trainer.main_ppo"
ONE_STEP_OFF = "verl.experimental.one_step_off_policy.main_ppo"
SGLANG = "actor_rollout_ref.rollout.engine_kwargs.sglang."


def main_ppo(*overrides: str):
    return compose_config(MAIN, ["--config-name=ppo_megatron_trainer", *OVERLAY, *overrides])


def task(module: str):
    def main():
        pass

    main.__module__ = module
    return main


# ---- trainer modes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_trainer_modes_that_force_naive_are_refused_with_the_fix(mode):
    cfg = main_ppo(f"trainer.v1.trainer_mode={mode}")
    with pytest.raises(P2PConfigError) as info:
        check_config(cfg, MAIN_PPO)
    text = str(info.value)
    assert f"trainer.v1.trainer_mode={mode}" in text and "`naive`" in text
    assert "Fix: trainer.v1.trainer_mode=separate_async" in text
    # the same config under one_step_off's entry point: trainer.v1 is not read there
    assert config_problems(cfg, entry_of(cfg, task(ONE_STEP_OFF))) == []


@pytest.mark.parametrize("module", [MAIN, ONE_STEP_OFF])
def test_the_overlay_separates_the_pools_and_a_colocated_rollout_is_refused_with_the_fix(module):
    """verl's default colocates the rollout (hybrid_engine=true), which p2p never writes: the overlay turns it off,
    and turning it back on is refused before launch (one_step_off asserts on it only after Ray started)."""
    name = "ppo_megatron_trainer" if module == MAIN else "one_step_off_ppo_megatron_trainer"
    extra = ["trainer.v1.trainer_mode=separate_async"] if module == MAIN else []
    cfg = compose_config(module, [f"--config-name={name}", *OVERLAY, *extra])
    assert cfg.actor_rollout_ref.hybrid_engine is False and config_problems(cfg, entry_of(cfg, task(module))) == []
    cfg = compose_config(module, [f"--config-name={name}", *OVERLAY, *extra, "actor_rollout_ref.hybrid_engine=true"])
    (problem,) = config_problems(cfg, entry_of(cfg, task(module)))
    assert "separate trainer and rollout GPU pools" in problem
    assert "Fix: actor_rollout_ref.hybrid_engine=false" in problem


def test_legacy_trainer_is_refused():
    (problem,) = config_problems(main_ppo("trainer.use_v1=false"), MAIN_PPO)
    assert "legacy trainer" in problem and "trainer.use_v1=true" in problem


def test_separate_async_passes_and_backend_other_than_p2p_is_not_checked():
    assert config_problems(main_ppo("trainer.v1.trainer_mode=separate_async"), MAIN_PPO) == []
    cfg = main_ppo("trainer.v1.trainer_mode=sync", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl")
    assert config_problems(cfg, MAIN_PPO) == []


def test_entry_is_taken_from_the_task_function_or_the_config_shape():
    cfg = main_ppo()
    assert entry_of(cfg) == "main_ppo"
    assert entry_of(cfg, task(ONE_STEP_OFF)) == "one_step_off"
    one_step_off = compose_config(ONE_STEP_OFF, ["--config-name=one_step_off_ppo_megatron_trainer", *OVERLAY])
    assert entry_of(one_step_off) == "one_step_off"


def test_hydra_callback_refuses_before_the_task_runs():
    cfg = main_ppo("trainer.v1.trainer_mode=sync")
    # Hydra turns a callback's exception into a warning and runs the job anyway: the refusal is a SystemExit
    with pytest.raises(SystemExit, match="(?s)verl_p2p refused the run: .*trainer_mode=sync"):
        P2PGuardCallback().on_job_start(cfg, task_function=task(MAIN))
    P2PGuardCallback().on_job_start(cfg, task_function=task(ONE_STEP_OFF))  # not read there: passes


RUN = """
    import hydra, verl, os, sys

    @hydra.main(config_path=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                config_name="ppo_megatron_trainer", version_base=None)
    def main(config):
        print("TASK RAN")

    sys.argv = ["main"] + sys.argv[1:]
    main()
"""


def test_hydra_callback_stops_a_real_hydra_run(tmp_path):
    """`@hydra.main` with the overlay: Hydra instantiates the callback from the config and it refuses."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(RUN),
            f"hydra.searchpath=[file://{CONF}]",
            "+p2p=default",
            "trainer.v1.trainer_mode=colocate_async",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "1", "VERL_USE_EXTERNAL_PLUGINS": "none"},
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "TASK RAN" not in proc.stdout
    assert "verl_p2p refused the run" in proc.stderr and "trainer.v1.trainer_mode=colocate_async" in proc.stderr


# ---- SGLang server args (config) ---------------------------------------------------------------------------


def test_memory_saver_on_is_refused_with_the_reason():
    cfg = main_ppo("trainer.v1.trainer_mode=separate_async", f"{SGLANG}{MEMORY_SAVER}=true")
    (problem,) = config_problems(cfg, MAIN_PPO)
    assert "disables the transfer-engine seed when the memory saver is on" in problem
    assert f"set {SGLANG}{MEMORY_SAVER}=false" in problem


def test_missing_server_args_name_the_override_that_fixes_them():
    cfg = main_ppo(
        "trainer.v1.trainer_mode=separate_async",
        f"~{SGLANG}{SEED_FLAG}",
        f"~{SGLANG}{MEMORY_SAVER}",
        f"~{SGLANG}{BOOTSTRAP_PORT}",
    )
    problems = config_problems(cfg, MAIN_PPO)
    assert len(problems) == 3
    assert f"set {SGLANG}{SEED_FLAG}=true" in problems[0]
    assert "verl launches SGLang with it on" in problems[1] and f"{MEMORY_SAVER}=false" in problems[1]
    assert f"set {SGLANG}{BOOTSTRAP_PORT}=6789" in problems[2]


def test_rollout_name_and_p2p_options_are_checked():
    cfg = main_ppo(
        "trainer.v1.trainer_mode=separate_async",
        "actor_rollout_ref.rollout.name=vllm",
        "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.verl_p2p.bucket_mb=8",
        "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.verl_p2p.protocol=ib",
    )
    problems = config_problems(cfg, MAIN_PPO)
    assert len(problems) == 2
    assert "rollout.name='vllm'" in problems[0] and "Fix: actor_rollout_ref.rollout.name=sglang" in problems[0]
    assert (
        "unknown checkpoint_engine.engine_kwargs.verl_p2p (engine_kwargs.p2p with backend=p2p) key(s) " in problems[1]
    )
    assert "['bucket_mb']" in problems[1]
    assert "valid keys" in problems[1]


# ---- SGLang server args (per replica, and live) ----------------------------------------------------------------


def rollout_config(backend: str = "p2p", **sglang) -> RolloutConfig:
    server_args = {**launch.p2p_server_args(7000), **sglang}
    return RolloutConfig(
        name="sglang",
        engine_kwargs={"sglang": server_args, "vllm": {}},
        checkpoint_engine=CheckpointEngineConfig(backend=backend),
    )


def replica(config, rank: int, mode: RolloutMode = RolloutMode.STANDALONE, **kw):
    """Stand-in for a verl SGLangReplica about to launch (the attributes launch_servers reads)."""
    return SimpleNamespace(config=config, replica_rank=rank, rollout_mode=mode, **kw)


def test_each_standalone_replica_gets_its_own_bootstrap_port_and_shared_config_is_untouched():
    shared = rollout_config(mem_fraction_static=0.8)
    replicas = [replica(shared, rank) for rank in (2, 3, 4)]
    for r in replicas:
        launch.apply_to_replica(r)
    ports = [r.config.engine_kwargs["sglang"][BOOTSTRAP_PORT] for r in replicas]
    assert ports == [7002, 7003, 7004]
    assert all(r.config.engine_kwargs["sglang"]["mem_fraction_static"] == 0.8 for r in replicas)
    assert all(r.config.engine_kwargs["sglang"][MEMORY_SAVER] is False for r in replicas)
    assert shared.engine_kwargs["sglang"][BOOTSTRAP_PORT] == 7000  # the config all replicas got is unchanged
    assert isinstance(replicas[0].config, RolloutConfig) and replicas[0].config.engine_kwargs["vllm"] == {}


def test_hybrid_reward_and_non_p2p_replicas_keep_verls_server_args():
    hybrid = replica(rollout_config(), 0, RolloutMode.HYBRID)
    launch.apply_to_replica(hybrid)
    assert not set(launch.P2P_SERVER_ARGS) & set(hybrid.config.engine_kwargs["sglang"])  # verl's memory saver
    for other in (replica(rollout_config("nccl"), 1), replica(rollout_config(), 1, is_reward_model=True)):
        before = copy.deepcopy(other.config.engine_kwargs)
        launch.apply_to_replica(other)
        assert other.config.engine_kwargs == before


def test_replica_launch_refuses_bad_server_args():
    with pytest.raises(P2PConfigError, match="cannot work with p2p"):
        launch.apply_to_replica(replica(rollout_config(**{MEMORY_SAVER: True}), 0))
    with pytest.raises(P2PConfigError, match="exceeds 65535"):
        launch.apply_to_replica(replica(rollout_config(**{BOOTSTRAP_PORT: 65535}), 3))
    with pytest.raises(P2PConfigError, match="not a TCP port"):
        launch.check_server_args({**launch.p2p_server_args(), BOOTSTRAP_PORT: "http"})


def test_live_server_args_explain_why_nothing_is_published():
    launch.check_live_server_args({SEED_FLAG: True}, engine=0, url="http://h:1")
    with pytest.raises(P2PConfigError, match=r"rollout engine 0 \(http://h:1\).*memory saver"):
        launch.check_live_server_args({SEED_FLAG: False, MEMORY_SAVER: True}, engine=0, url="http://h:1")
    with pytest.raises(P2PConfigError, match="could not import mooncake.engine"):
        launch.check_live_server_args({SEED_FLAG: False, MEMORY_SAVER: False}, engine=0, url="http://h:1")
    with pytest.raises(P2PConfigError, match="needs SGLang >= 0.5.12"):
        launch.check_live_server_args({"version": "0.4.0"}, engine=0, url="http://h:1")


def test_trainer_rank0_warns_once_about_hybrid_replicas(caplog, monkeypatch):
    monkeypatch.setattr("verl_p2p.backend.guards._warned", set())
    owner = SimpleNamespace(config={"hybrid_engine": True})
    with caplog.at_level(logging.WARNING, logger="verl_p2p.backend.guards"):
        warn_hybrid_actor(owner)
        warn_hybrid_actor(owner)
        warn_hybrid_actor(SimpleNamespace(config={"hybrid_engine": False}))
    assert caplog.text.count("synced by verl's naive path") == 1

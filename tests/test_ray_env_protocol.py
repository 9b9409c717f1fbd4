"""`protocol` set once reaches the trainer and the rollout processes in verl 0.9.1's real launch path.

verl's run_ppo hands `ray_kwargs.ray_init` to `ray.init` unresolved; conf/p2p/default.yaml's Hydra callback
(`verl_p2p.backend.ray_env.P2PRayEnvCallback`) resolves it when the run starts, and refuses at job start what
would still reach Ray wrong: an interpolation left over, or a MOONCAKE_PROTOCOL that differs from `protocol`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hydra._internal.callbacks import Callbacks
from support.compose import CONF, ROOT, compose_config
from test_hydra_recipes import ray_env_as_verl_passes_it

ONE_STEP_OFF = "verl.experimental.one_step_off_policy.main_ppo"
KWARGS = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.verl_p2p"
ENV = "ray_kwargs.ray_init.runtime_env.env_vars"
# what a user writes (README): verl's own one_step_off FSDP config, p2p's overlay, the protocol once
USER_ARGS = [
    "--config-name=one_step_off_ppo_trainer",
    f"hydra.searchpath=[pkg://verl.trainer.config,file://{CONF}]",
    "+p2p=fsdp",
    f"{KWARGS}.protocol=tcp",
    "actor_rollout_ref.hybrid_engine=false",
]


def test_protocol_given_once_reaches_the_trainer_and_a_rollout_server_actor_through_verls_launch(tmp_path):
    """verl's one_step_off main (Hydra's main, the config's callbacks, verl's run_ppo building the runtime env and
    starting a local Ray cluster) with a stand-in task runner that reports what the processes see."""
    out = tmp_path / "seen.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}  # RAY_AUTH_MODE: conftest.py
    args = [*USER_ARGS, "ray_kwargs.ray_init.num_cpus=1", "+ray_kwargs.ray_init.include_dashboard=false"]
    probe = ROOT / "tests" / "support" / "launch_probe.py"
    run = subprocess.run(
        [sys.executable, str(probe), str(out), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads(out.read_text()) == {
        "task_runner_env": "tcp",
        "trainer_protocol": "tcp",
        "server_actor_env": "tcp",
    }


def test_the_callback_resolves_every_interpolation_verl_would_hand_ray_as_text():
    cfg = compose_config(ONE_STEP_OFF, [*USER_ARGS, f"+{ENV}.RUN_NAME=run-${{trainer.project_name}}"])
    env = ray_env_as_verl_passes_it(cfg)
    assert env["MOONCAKE_PROTOCOL"] == "tcp" and env["RUN_NAME"] == f"run-{cfg.trainer.project_name}"


def test_a_mooncake_protocol_set_apart_from_protocol_is_refused_before_ray_starts():
    cfg = compose_config(ONE_STEP_OFF, [*USER_ARGS, f"{ENV}.MOONCAKE_PROTOCOL=rdma"])
    callbacks = Callbacks(cfg)
    callbacks.on_run_start(config=cfg, config_name=None)
    with pytest.raises(SystemExit, match=f"{ENV}.MOONCAKE_PROTOCOL='rdma' but {KWARGS}.protocol='tcp'.*Fix: set"):
        callbacks.on_job_start(config=cfg, task_function=None)


def test_an_interpolation_left_for_ray_is_refused_naming_it():
    """A multirun sweep composes each job anew, without the run-start resolution: refused, not sent as text."""
    cfg = compose_config(ONE_STEP_OFF, USER_ARGS)
    with pytest.raises(SystemExit, match=r"MOONCAKE_PROTOCOL='\$\{actor_rollout_ref.* literal text. Fix: set"):
        Callbacks(cfg).on_job_start(config=cfg, task_function=None)

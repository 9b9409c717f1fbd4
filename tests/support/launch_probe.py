"""verl's real one_step_off launch with a probe in place of its task runner (test support).

`python launch_probe.py <out.json> <Hydra args>` runs verl 0.9.1's `one_step_off_policy.main_ppo.main`: Hydra's
main with the config's callbacks, verl's `run_ppo`, which builds the Ray runtime env from the config and starts
Ray. The task runner is a stand-in (named as one: it trains nothing) that writes what verl's processes would see:
its own MOONCAKE_PROTOCOL (the trainer workers inherit the job's env), the protocol p2p's trainer side reads from
its options, and MOONCAKE_PROTOCOL in an actor started the way verl starts an SGLang server actor (its own
runtime_env env_vars merged over the job's), which the SGLang server processes inherit.
"""

from __future__ import annotations

import json
import os
import sys

import ray
from omegaconf import OmegaConf

OUT = sys.argv[1]


@ray.remote(num_cpus=0)
class ServerActorProbe:
    """Where verl's rollout server actor runs (async_sglang_server.py passes env_vars of its own)."""

    def protocol(self) -> str | None:
        return os.environ.get("MOONCAKE_PROTOCOL")


@ray.remote(num_cpus=0)
class TaskRunnerProbe:
    """A stand-in for verl's OneStepTaskRunner: reports instead of training."""

    def run(self, config) -> None:
        from verl_p2p.config import P2PConfig

        OmegaConf.resolve(config)  # as verl's task runners do first
        engine = config.actor_rollout_ref.rollout.checkpoint_engine
        options = P2PConfig.from_mapping(engine.engine_kwargs[engine.backend])
        server = ServerActorProbe.options(
            runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        ).remote()
        seen = {
            "task_runner_env": os.environ.get("MOONCAKE_PROTOCOL"),
            "trainer_protocol": options.protocol,
            "server_actor_env": ray.get(server.protocol.remote()),
        }
        with open(OUT, "w") as f:
            json.dump(seen, f)


if __name__ == "__main__":
    import verl.experimental.one_step_off_policy.main_ppo as entry

    entry.OneStepTaskRunner = TaskRunnerProbe  # run_ppo(config, task_runner_class=OneStepTaskRunner)
    # `python -m` finds the entry's config dir from its file; called from here, Hydra is told it
    config_dir = os.path.join(os.path.dirname(entry.__file__), "config")
    sys.argv = [entry.__file__, f"--config-path={config_dir}", *sys.argv[2:]]
    try:
        entry.main()
    finally:
        ray.shutdown()

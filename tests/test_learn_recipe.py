"""The learning runs of issue 34, one per backend, compose against verl 0.9.1 and pass verl's own config checks
with the same task, settings and seeds; the negative control's engine (recipes/learn/control_engine.py, a
stand-in) resolves through verl's registry and moves no weight; the run's summary requires its rollout to differ
from a fresh server on the trainer's export."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from support.compose import ROOT, compose_config, recipe_command, task_config
from test_hydra_recipes import check_p2p_config

LEARN_GRPO = ROOT / "recipes" / "learn_grpo.sh"
LEARN_ASYNC = ROOT / "recipes" / "learn_fully_async.sh"
BACKENDS = ("verl_p2p", "mooncake", "control")
# what must be the same in every backend's run: the task, the GRPO settings, the seeds
SAME = (
    "reward.custom_reward_function.path",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    "data.max_response_length",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "data.seed",
    "actor_rollout_ref.actor.data_loader_seed",
    "actor_rollout_ref.actor.megatron.seed",
    "actor_rollout_ref.rollout.seed",
    "actor_rollout_ref.rollout.engine_kwargs.sglang.random_seed",
    "trainer.total_training_steps",
)


def composed(script: Path, **env: str):
    module, args = recipe_command(script, **env)
    return module, compose_config(module, args)


def learn_on_path() -> None:
    """recipes/learn on the import path, as tiny_args.sh puts it on PYTHONPATH for BACKEND=control."""
    folder = str(ROOT / "recipes" / "learn")
    if folder not in sys.path:
        sys.path.insert(0, folder)


def control_module():
    """recipes/learn/control_engine.py imported as verl imports it (custom_backend_module)."""
    from verl.utils.import_utils import import_external_libs

    learn_on_path()
    import_external_libs("control_engine")
    return sys.modules["control_engine"]


def check_backend(cfg, module: str, backend: str) -> None:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import CheckpointEngineConfig

    rollout = cfg.actor_rollout_ref.rollout
    if backend == "verl_p2p":
        check_p2p_config(cfg, module)
        assert rollout.checkpoint_engine.engine_kwargs["verl_p2p"]["check_weight_update_equal"] is True
        return
    assert rollout.checkpoint_engine.backend == backend and not rollout.get("checkpoint_manager_class")
    engine = omega_conf_to_dataclass(rollout.checkpoint_engine)
    assert isinstance(engine, CheckpointEngineConfig)
    if backend == "control":  # verl imports the stand-in in every worker; its registry then resolves the name
        assert engine.custom_backend_module == "control_engine"
        engine_class = control_module().NoSyncCheckpointEngine
        assert CheckpointEngineRegistry.get("control") is engine_class
    assert rollout.name == "sglang" and rollout.load_format == "auto" and cfg.trainer.resume_mode == "disable"


@pytest.mark.parametrize("one_gpu", ["0", "1"], ids=["2gpu", "1gpu"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_step_off_learning_run_passes_verls_config_validation(backend, one_gpu):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    module, cfg = composed(LEARN_GRPO, BACKEND=backend, ONE_GPU=one_gpu)
    assert module == "verl.experimental.one_step_off_policy.main_ppo"
    check_backend(cfg, module, backend)
    assert cfg.trainer.total_training_steps == 40 and cfg.data.train_batch_size == 16
    assert cfg.trainer.val_before_train is True and cfg.trainer.test_freq == 40  # validation at start and end
    assert cfg.reward.custom_reward_function.path == str(ROOT / "recipes" / "learn" / "reward.py")
    assert cfg.data.train_files.startswith("/tmp/verl-p2p-learn/")
    cfg = task_config(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fsdp_trainer_learning_run_passes_verls_config_validation(backend):
    """TRAINER=fsdp: the same task on verl's FSDP2 trainer (its one_step_off config, p2p's +p2p=fsdp overlay, SDPA
    attention: the GPU stack carries no flash-attn), validated by verl as the Megatron run is; nothing of Megatron
    is left in the command line."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_p2p.backend.guards import config_problems

    module, args = recipe_command(LEARN_GRPO, BACKEND=backend, ONE_GPU="1", TRAINER="fsdp", SEED="7")
    assert "--config-name=one_step_off_ppo_trainer" in args and not [a for a in args if "megatron" in a]
    cfg = compose_config(module, args)
    check_backend(cfg, module, backend)
    actor = cfg.actor_rollout_ref.actor
    assert actor.strategy == "fsdp2" and cfg.actor_rollout_ref.ref.strategy == "fsdp2"
    assert actor.fsdp_config.seed == 7 and actor.use_torch_compile is False
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    if backend == "verl_p2p":
        assert cfg.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.verl_p2p.export_mode == "auto"
        assert config_problems(cfg, guard=True) == []
    cfg = task_config(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def test_an_unknown_trainer_is_refused_before_anything_starts():
    import subprocess

    env = {"PATH": "/usr/bin:/bin", "TRAINER": "deepspeed", "P2P_PRINT_COMMAND": "1"}
    proc = subprocess.run(["bash", str(LEARN_GRPO)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "TRAINER=deepspeed: expected megatron or fsdp" in proc.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_async_learning_run_has_partial_rollouts_on(backend):
    """fully_async is not validated by verl's PPO validate_config (it refuses the train_batch_size 0 fully_async
    needs): what verl's rollouter asserts is checked, and verl's dataclasses build the rollout section."""
    module, cfg = composed(LEARN_ASYNC, BACKEND=backend, ONE_GPU="1")
    assert module == "verl.experimental.fully_async_policy.fully_async_main"
    check_backend(cfg, module, backend)
    assert cfg.async_training.partial_rollout is True and cfg.async_training.trigger_parameter_sync_step == 1
    assert cfg.rollout.total_rollout_steps == 16 * 60 and cfg.trainer.test_freq == 60
    assert cfg.data.train_batch_size == 0 and cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    assert cfg.data.max_response_length == 64 and cfg.reward.custom_reward_function.path.endswith("learn/reward.py")
    assert cfg.trainer.experiment_name == f"learn-fully-async-{backend}"


def test_every_backend_runs_the_same_task_with_the_same_seeds():
    for script in (LEARN_GRPO, LEARN_ASYNC):
        configs = {b: composed(script, BACKEND=b, SEED="7")[1] for b in BACKENDS}
        for key in SAME:
            values = {b: OmegaConf.select(cfg, key) for b, cfg in configs.items()}
            assert len({json.dumps(v) for v in values.values()}) == 1, (script.name, key, values)
        assert OmegaConf.select(configs["control"], "data.seed") == 7


def test_an_unknown_backend_is_refused_before_anything_starts():
    import subprocess

    proc = subprocess.run(
        ["bash", str(LEARN_GRPO)], env={"PATH": "/usr/bin:/bin", "BACKEND": "nccl2", "P2P_PRINT_COMMAND": "1"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (
        proc.returncode == 2 and "BACKEND=nccl2: expected p2p (or verl_p2p), mooncake, nixl or control" in proc.stderr
    )


# ---- the negative control's engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """The learning task's real model (make_learn), twice through transformers on CPU: the rollout's, and the
    trainer's after an update (every tensor moved)."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("make_learn_ctl", ROOT / "recipes" / "learn" / "make_learn.py")
    make_learn = importlib.util.module_from_spec(spec)
    sys.modules["make_learn_ctl"] = make_learn
    spec.loader.exec_module(make_learn)
    path = tmp_path_factory.mktemp("ctl") / "model"
    make_learn.write_model(path, seed=0)
    rollout = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01)
    return rollout, trainer


def sync_once(backend: str, rollout, trainer) -> tuple[dict, int, int]:
    """One sync as verl's CheckpointEngineManager drives it (prepare, build_topology, init_process_group, send on
    the trainer side, receive into the rollout, finalize), the rollout loading whatever arrives. Returns (the
    sender's metrics, tensors the trainer's export yielded, tensors the rollout loaded)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    if backend == "control":
        control_module()
    sender = CheckpointEngineRegistry.new(backend, bucket_size=1 << 20, is_master=True)
    receiver = CheckpointEngineRegistry.new(backend, bucket_size=1 << 20)
    yielded = 0

    def export():
        nonlocal yielded
        for name, tensor in trainer.state_dict().items():
            yielded += 1
            yield name, tensor.detach().clone()

    async def run() -> tuple[dict, int]:
        if backend == "naive":  # verl's colocated engine: no topology, the receiver reads what was sent
            metrics = sender.send_weights(export()) or {}
            received = list(sender.receive_weights())
        else:
            metadata = [sender.prepare(), receiver.prepare()]
            actor_kwargs, rollout_kwargs = type(sender).build_topology(1, 1, metadata)
            sender.init_process_group(**{k: v[0] for k, v in actor_kwargs.items()})
            receiver.init_process_group(**{k: v[0] for k, v in rollout_kwargs.items()})
            metrics = await sender.send_weights(export(), global_steps=1)
            received = [item async for item in receiver.receive_weights(global_steps=1)]
            sender.finalize()
            receiver.finalize()
        rollout.load_state_dict(dict(received), strict=False)
        return metrics, len(received)

    metrics, loaded = asyncio.run(run())
    return metrics, yielded, loaded


def test_verls_registry_resolves_the_control_and_it_moves_no_weight(tiny_models):
    """The stand-in reads the trainer's export to its end (every tensor) and the rollout keeps every weight bit for
    bit; the same harness with verl's own colocated engine moves them, so it would see a moved weight."""
    import torch
    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry
    from verl.workers.config import CheckpointEngineConfig

    rollout, trainer = tiny_models
    before = {k: v.clone() for k, v in rollout.state_dict().items()}
    learn_on_path()
    config = CheckpointEngineConfig(backend="control", custom_backend_module="control_engine")
    manager = CheckpointEngineManager(config, actor_wg=None, replicas=[])  # verl imports the module and resolves
    engine_class = sys.modules["control_engine"].NoSyncCheckpointEngine
    assert manager.backend_cls is CheckpointEngineRegistry.get("control") is engine_class

    metrics, yielded, loaded = sync_once("control", rollout, trainer)
    assert yielded == len(before) and loaded == 0
    assert metrics == {"checkpoint_engine/control/tensors_dropped": float(len(before))}
    assert all(torch.equal(rollout.state_dict()[k], v) for k, v in before.items())

    _, yielded, loaded = sync_once("naive", rollout, trainer)  # the harness sees a sync that moves weights
    assert loaded == yielded == len(before)
    assert all(torch.equal(rollout.state_dict()[k], trainer.state_dict()[k]) for k in before)
    assert not torch.equal(rollout.state_dict()["lm_head.weight"], before["lm_head.weight"])


def test_the_control_refuses_options_it_would_ignore():
    engine = control_module().NoSyncCheckpointEngine
    with pytest.raises(ValueError, match=r"backend=control takes no engine_kwargs.control options, got \['protocol'\]"):
        engine(bucket_size=1, protocol="tcp")


def test_the_control_is_no_part_of_the_package():
    assert not list((ROOT / "verl_p2p").rglob("*control_engine*"))
    text = "\n".join(p.read_text() for p in (ROOT / "verl_p2p").rglob("*.py"))
    assert "NoSyncCheckpointEngine" not in text and '"control"' not in text


# ---- the run's summary ---------------------------------------------------------------------------------------------

spec = importlib.util.spec_from_file_location("grpo_check_learn", ROOT / "scripts" / "grpo_check.py")
grpo_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grpo_check)


def summary(tmp_path: Path, backend: str, compare: dict) -> dict:
    lines = [
        f"(OneStepTaskRunner pid=7) step:{s} - training/global_step:{s} - timing_s/update_weights:0.0{s}"
        for s in (1, 2, 3, 4)
    ]
    (tmp_path / "run.log").write_text("\n".join(lines) + "\n")
    (tmp_path / "compare.json").write_text(json.dumps(compare))
    (tmp_path / "probe.json").write_text(json.dumps({"records": {"0": {}, "4": {}}}))
    grpo_check.main(
        ["summary", "--log", str(tmp_path / "run.log"), "--metrics", str(tmp_path / "none.jsonl"),
         "--probe", str(tmp_path / "probe.json"), "--compare", str(tmp_path / "compare.json"), "--steps", "4",
         "--rc", "0", "--out", str(tmp_path / "s.json"), "--backend", backend, "--expect-check", "none",
         "--final-version", "4"]
    )  # fmt: skip
    return json.loads((tmp_path / "s.json").read_text())


DIFFER = {"equal": False, "greedy_equal": False, "checksums_equal": False, "checksums_compared": 19}
EQUAL = {"equal": True, "greedy_equal": True, "checksums_equal": True, "checksums_compared": 19}


def test_the_controls_rollout_must_differ_from_a_fresh_server_on_the_trainers_export(tmp_path):
    s = summary(tmp_path, "control", DIFFER)
    assert s["ok"] and s["fresh_server_expected"] == "differ" and s["backend"] == "control"
    assert not summary(tmp_path, "control", EQUAL)["ok"]  # the weights moved: the control did not cut the sync
    assert not summary(tmp_path, "control", {**DIFFER, "error": "no rollout output at version 4"})["ok"]
    assert not summary(tmp_path, "control", {**DIFFER, "checksums_compared": 0})["ok"]
    # every engine that syncs still needs the rollout equal to the fresh server
    assert summary(tmp_path, "mooncake", EQUAL)["ok"] and not summary(tmp_path, "mooncake", DIFFER)["ok"]

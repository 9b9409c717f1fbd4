"""The rollout server's launch check decides FP8 from the checkpoint the server loads (finding R31).

verl 0.9.1's server hands SGLang `model_path=model_config.local_path` (the trainer's model) unless
`engine_kwargs.sglang.model_path` overrides it: the documented FP8 deployment keeps a bf16 trainer model beside
the rollout's block-FP8 copy. The check runs in `P2PServerLaunch.launch_server` (what `P2PSGLangHttpServer` mixes
in before verl's server), here over a stand-in server actor with verl's real RolloutConfig and HFModelConfig.
"""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

import pytest

from verl_p2p.errors import P2PConfigError, QuantizationError
from verl_p2p.replica.fp8 import Fp8Platform
from verl_p2p.rollout.launch import P2PServerLaunch, p2p_server_args

ROOT = Path(__file__).resolve().parents[1]
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
BLACKWELL = Fp8Platform(hip=False, scale_ue8m0=True)  # stand-in for a GPU this host lacks
HOPPER = Fp8Platform(hip=False, scale_ue8m0=False)


class StandInVerlServer:
    """STAND-IN for verl's SGLangHttpServer, whose module imports SGLang's HTTP server (GPU-host packages): it
    holds verl's two configs as that actor does, and its launch_server records the launch instead of starting
    SGLang."""

    def __init__(self, config, model_config):
        self.config = config
        self.model_config = model_config
        self.launched = False

    async def launch_server(self, master_address=None, master_port=None):
        self.launched = True


class StandInP2PServer(P2PServerLaunch, StandInVerlServer):
    """P2PSGLangHttpServer's composition, over the stand-in."""


@pytest.fixture(scope="module")
def trainer_model(tmp_path_factory):
    """verl's HFModelConfig of a tiny bf16 Qwen3 (the trainer's model)."""
    from transformers import Qwen3Config
    from verl.workers.config import HFModelConfig

    path = tmp_path_factory.mktemp("bf16")
    Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=128,
        torch_dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(path)
    return HFModelConfig(path=str(path), load_tokenizer=False)


@pytest.fixture
def fp8_copy(tmp_path, trainer_model):
    """The rollout's block-FP8 copy: the trainer's config.json with a quantization_config."""
    config = json.loads((Path(trainer_model.local_path) / "config.json").read_text())
    path = tmp_path / "fp8"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}))
    return path


@pytest.fixture
def gpu(monkeypatch):
    """Which FP8 platform the rollout's GPU is (a stand-in: this host has none)."""

    def use(platform: Fp8Platform) -> None:
        monkeypatch.setattr(Fp8Platform, "local", classmethod(lambda cls: platform))

    return use


def rollout_config(sglang_extra=None, backend="verl_p2p", **fields):
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    sglang = {**p2p_server_args(), "device": "cuda", **(sglang_extra or {})}
    ce = CheckpointEngineConfig(backend=backend, engine_kwargs={backend: {}} if backend == "verl_p2p" else {})
    return RolloutConfig(name="sglang", mode="async", checkpoint_engine=ce, engine_kwargs={"sglang": sglang}, **fields)


def launch(config, model_config) -> StandInP2PServer:
    server = StandInP2PServer(config, model_config)
    asyncio.run(server.launch_server())
    return server


def test_an_fp8_rollout_checkpoint_beside_a_bf16_trainer_model_is_refused_on_a_gpu_that_rewrites_fp8(
    trainer_model, fp8_copy, gpu
):
    gpu(BLACKWELL)
    server = StandInP2PServer(rollout_config({"model_path": str(fp8_copy)}), trainer_model)
    with pytest.raises(QuantizationError, match=rf"loading {fp8_copy}: block-FP8 rollout on Blackwell") as info:
        asyncio.run(server.launch_server())
    assert not server.launched and str(info.value).startswith("rollout server on ")
    # the trainer's own bf16 model on the same GPU is not an FP8 rollout; the FP8 copy on Hopper launches
    assert launch(rollout_config(), trainer_model).launched
    gpu(HOPPER)
    assert launch(rollout_config({"model_path": str(fp8_copy)}), trainer_model).launched


def test_verls_own_fp8_quantization_of_the_trainer_model_is_checked_too(trainer_model, gpu):
    """verl's `rollout.quantization=fp8` (not under engine_kwargs.sglang) makes the server FP8 as well."""
    gpu(BLACKWELL)
    with pytest.raises(QuantizationError, match=r"block-FP8 rollout on Blackwell"):
        launch(rollout_config(quantization="fp8"), trainer_model)


@pytest.mark.parametrize("what", ["missing", "not json"])
def test_a_checkpoint_whose_config_cannot_be_read_is_refused_naming_the_path_and_fix(
    tmp_path, trainer_model, gpu, what
):
    gpu(HOPPER)
    served = tmp_path / "elsewhere"
    served.mkdir()
    if what == "not json":
        (served / "config.json").write_text("{not json")
    server = StandInP2PServer(rollout_config({"model_path": str(served)}), trainer_model)
    with pytest.raises(P2PConfigError, match=rf"cannot read {served}/config\.json") as info:
        asyncio.run(server.launch_server())
    assert "set actor_rollout_ref.rollout.engine_kwargs.sglang.model_path to the local HF checkpoint" in str(info.value)
    assert not server.launched


def test_another_backend_launches_as_verl_does(tmp_path, trainer_model, gpu):
    gpu(BLACKWELL)
    config = rollout_config({"model_path": str(tmp_path / "nowhere")}, backend="naive")
    assert launch(config, trainer_model).launched


def test_verls_server_actor_gets_the_launch_checks_first():
    """P2PSGLangHttpServer (not importable on this host: SGLang's server needs GPU-host packages) mixes
    P2PServerLaunch in before verl's server class, so its launch_server is the one above."""
    tree = ast.parse((ROOT / "verl_p2p" / "rollout" / "sglang_replica.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "P2PSGLangHttpServer"]
    assert [ast.unparse(base) for base in cls.bases] == ["P2PServerLaunch", "SGLangHttpServer"]
    assert not [n for n in cls.body if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef)]

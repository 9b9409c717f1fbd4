"""check_weight_update_equal on an FP8 rollout, bit for bit, on the loopback.

One loopback engine (TP2/EP2, real SGLang ranks loading the trainer's block-FP8 checkpoint with SGLang's Fp8
methods) and the production trainer side, whose own model path is the bf16 checkpoint (`rollout_model_path`
names the FP8 copy the rollout serves): SourceSession (replica built with the checkpoint's quant config,
compiled executor checked by verify_first_push, the quantize step, real Mooncake tcp writes), driven by
SyncLifecycle with check_weight_update_equal. The trainer streams *bf16* tensors; the rollout's snapshot is
the FP8 checkpoint it loaded. The compare passes with allow_quant_error off; a trainer weight that changed
(one block's amax doubled) changes that block's FP8 bytes and its scale, and the compare names the tensors.
Stand-in: verl's Megatron engine (the HF stream is the bf16 checkpoint's tensors), as in test_source_session.
"""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import pytest
import torch

from verl_p2p.config import P2PConfig

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=256, head_dim=128, moe_intermediate_size=512, intermediate_size=512)
VICTIM = "model.layers.1.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def fp8_engine(tmp_path_factory):
    from safetensors.torch import load_file

    from verl_p2p.loopback.engine import EngineSpec, LoopbackEngine
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.sandbox.tiny import hf_tensor_shapes, write_tiny_checkpoint
    from verl_p2p.trainer.fp8_checkpoint import quantize_checkpoint

    install_cpu_stubs()
    root = tmp_path_factory.mktemp("fp8_checker")
    bf16 = write_tiny_checkpoint(root / "bf16", "qwen3_moe", id_encoded=False, dtype=torch.bfloat16, **SHAPE)
    fp8 = quantize_checkpoint(bf16, root / "fp8")
    cfg = json.loads((bf16 / "config.json").read_text())  # the trainer's model path: bf16, no quantization_config
    tensors = load_file(str(bf16 / "model.safetensors"))
    hf = [(n, tensors[n]) for n, _ in hf_tensor_shapes(cfg)]
    engine = LoopbackEngine(EngineSpec(tp=2, ep=2, dtype="bfloat16", rank_timeout_s=60), str(fp8))
    engine.start()
    try:
        engine.wait_ready()
        yield engine, cfg, bf16, fp8, hf
    finally:
        engine.stop()


class EngineStandIn:
    """verl's MegatronEngine as SourceSession reads it: the rollout checkpoint's config and path, a bf16 stream."""

    def __init__(self, cfg, path, hf):
        self.model_config = SimpleNamespace(hf_config=cfg, local_path=str(path))
        self.hf = hf

    def stream(self):
        yield from self.hf


def _sync(engine, source, config, step: int):
    from verl_p2p.backend.topology import sole_source_assignment
    from verl_p2p.rollout.adapter import P2PReplicaAdapter
    from verl_p2p.rollout.lifecycle import SyncLifecycle

    lifecycle = SyncLifecycle([P2PReplicaAdapter(0, engine.url, config=config)], config, frees_kv=True)

    async def push(connection):
        source.apply(sole_source_assignment(connection))
        return {"metrics": await asyncio.to_thread(source.push)}

    try:
        return asyncio.run(lifecycle.sync(step, push))
    finally:
        lifecycle.close()


def test_fp8_sync_passes_the_bitwise_weight_check_and_a_changed_weight_fails_it(fp8_engine, monkeypatch):
    from verl_p2p.rollout.lifecycle import SyncError
    from verl_p2p.trainer import verl_engine
    from verl_p2p.trainer.source import SourceSession

    engine, cfg, bf16, fp8, hf = fp8_engine
    trainer = EngineStandIn(cfg, bf16, hf)
    monkeypatch.setattr(verl_engine, "find_megatron_engine", lambda owner: trainer)
    monkeypatch.setattr(verl_engine, "engine_exporter", lambda eng, mode: SimpleNamespace(mode=mode))
    monkeypatch.setattr(verl_engine, "export_engine_stage", lambda exporter, eng, **kwargs: eng.stream())
    config = P2PConfig(
        protocol="tcp",
        hostname="127.0.0.1",
        bucket_size_mb=1,
        release_buffers_on_save=False,
        check_weight_update_equal=True,
        verify_first_push=True,
        rollout_model_path=str(fp8),  # the rollout serves the FP8 copy; the trainer's own path is bf16
        http_timeout=60.0,
        p2p_transfer_timeout=30.0,
    )
    before = engine.dump(1)
    assert before["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn

    source = SourceSession(config, owner=object(), hostname="127.0.0.1")
    try:
        report = _sync(engine, source, config, 1)
        assert "check_compare" in report.phases  # snapshot, reset to random, push, compare: all bytes equal
        after = engine.dump(1)
        for name, t in before.items():
            assert torch.equal(after[name].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), name

        changed = dict(hf)
        w = changed[VICTIM].clone()
        w[3, 5] = w.abs().max() * 2  # a new amax for block (0, 0): its scale and all its FP8 bytes change
        changed[VICTIM] = w
        trainer.hf = [(n, changed[n]) for n, _ in hf]
        with pytest.raises(SyncError) as failed:
            _sync(engine, source, config, 2)
    finally:
        source.close()
    text = str(failed.value)
    assert failed.value.failures[0].step == "check_compare"
    assert "name=model.layers.1.self_attn.o_proj.weight " in text
    assert "name=model.layers.1.self_attn.o_proj.weight_scale_inv " in text
    assert "qkv_proj" not in text  # every other tensor compared equal

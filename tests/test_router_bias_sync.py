"""A router's correction bias, a buffer on the trainer, follows a sync into the rollout (finding R22).

GLM-4.5 / DeepSeek-V3 / Kimi-K2 route with sigmoid scores plus `e_score_correction_bias`: a buffer on the trainer
(Megatron's `router.expert_bias`, persistent; HF's `mlp.gate.e_score_correction_bias` under FSDP), updated by
the aux-loss-free balancing outside the optimizer, and a parameter on the rollout (SGLang's MoEGate). A sync that
streamed parameters only would leave the rollout routing with the start-up bias.

Each test runs in a process of its own (Megatron's and torch.distributed's global state): the tiny GLM-4.5 (its
router has the bias; `verl_p2p.sandbox.tiny`), one loopback rollout engine (SGLang's Glm4MoeForCausalLM loaded by
SGLang's loader), the trainer's real engine, p2p's SourceSession (replica, compiled programs, Mooncake tcp writes)
and the real sync lifecycle. Only the bias moves, by a bit pattern that changes every byte of every element;
the rollout must then hold the trainer's bias bytes.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from verl_p2p.sandbox import forked

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
BIAS = "mlp.gate.e_score_correction_bias"  # the HF name's tail, and the rollout parameter's
# XOR of each float32: the sign bit and bytes 0-2 (mantissa bits only, as 0x01 < 0x80): every byte changes,
# the exponent does not, so every value stays finite
FLIP = 0x80010101 - (1 << 32)  # as a signed int32


def flipped(bias):
    import torch

    return (bias.detach().contiguous().view(torch.int32) ^ torch.tensor(FLIP, dtype=torch.int32)).view(torch.float32)


def _trainer(backend: str, model_dir: Path):
    """The trainer's engine, its router-bias buffers, and a function giving their HF names and values."""
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()  # the e2e trainer's stand-in for vllm's rotary op, which SGLang's GLM-4.5 imports on CPU
    if backend == "megatron":
        from verl_p2p.cli.demo import trainer_engine

        engine = trainer_engine(model_dir)
        buffers = [b for c in engine.module for n, b in c.named_buffers() if n.endswith("mlp.router.expert_bias")]

        def exported():  # the bridge's own names for them (its export reads persistent buffers too)
            stream = engine.bridge.export_hf_weights(
                engine.module, cpu=True, show_progress=False, merge_adapter_weights=False
            )
            return {n: t.clone() for n, t in stream if n.endswith(BIAS)}

        return engine, buffers, exported
    sys.path.insert(0, str(TESTS))
    from support.fsdp_ranks import cpu_platform_for_verl_fsdp, fsdp2_engine

    from verl_p2p.sandbox.cpu_megatron import free_port, init_distributed

    cpu_platform_for_verl_fsdp()
    init_distributed(0, 1, free_port())
    engine = fsdp2_engine(str(model_dir), world=1)
    named = {n: b for n, b in engine.module.named_buffers() if n.endswith(BIAS)}  # HF names under FSDP
    return engine, list(named.values()), lambda: {n: b.detach().clone() for n, b in named.items()}


async def _sync_once(engine_url: str, bootstrap_url: str, trainer) -> None:
    from verl_p2p.backend.topology import sole_source_assignment
    from verl_p2p.config import P2PConfig
    from verl_p2p.rollout.adapter import P2PReplicaAdapter
    from verl_p2p.rollout.lifecycle import SyncLifecycle
    from verl_p2p.trainer.source import SourceSession

    config = P2PConfig(protocol="tcp", hostname="127.0.0.1", p2p_transfer_timeout=30.0, http_timeout=30.0)
    lifecycle = SyncLifecycle([P2PReplicaAdapter(0, engine_url, bootstrap_url=bootstrap_url, config=config)], config)
    source = SourceSession(config, trainer, hostname="127.0.0.1")

    async def prepare(connection):
        plan = sole_source_assignment(connection, lifecycle.sessionless_engines())
        await asyncio.to_thread(source.apply, plan)

    async def push(connection):
        await prepare(connection)
        return {"metrics": await asyncio.to_thread(source.push)}

    try:
        await lifecycle.sync(1, push, prepare=prepare)
    finally:
        source.close()
        lifecycle.close()


def _run(backend: str, workdir: str, queue) -> None:
    try:
        queue.put(("ok", _body(backend, Path(workdir))))
    except BaseException as exc:  # report everything to the parent
        import traceback

        queue.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _body(backend: str, workdir: Path) -> dict:
    import torch

    from verl_p2p.loopback.engine import EngineSpec, LoopbackEngine
    from verl_p2p.sandbox.tiny import write_tiny_checkpoint

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    model_dir = write_tiny_checkpoint(workdir / "glm4_moe", "glm4_moe", id_encoded=False)
    rollout = LoopbackEngine(EngineSpec(tp=1, dtype="float32", rank_timeout_s=30), str(model_dir))
    rollout.start()
    try:
        trainer, buffers, exported = _trainer(backend, model_dir)
        rollout.wait_ready()
        before = rollout.dump(0)
        assert buffers, "the trainer holds no router bias"
        with torch.no_grad():
            for buffer in buffers:
                buffer.copy_(flipped(buffer))
        new = exported()
        asyncio.run(_sync_once(rollout.url, rollout.bootstrap_url, trainer))
        after = rollout.dump(0)
    finally:
        rollout.stop()
    report = {}
    for name, want in new.items():
        old, got = before[name], after[name]
        report[name] = {
            "every_byte_moved": bool((old.view(torch.uint8) != want.view(torch.uint8)).all()),
            "rollout_holds_the_trainers_bytes": got.dtype == want.dtype
            and torch.equal(got.view(torch.uint8), want.view(torch.uint8)),
        }
    others = [n for n in before if n not in new and not torch.equal(before[n], after[n])]
    return {"biases": report, "other_params_changed": others}


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_a_changed_router_bias_reaches_the_rollout(tmp_path, backend):
    queue = forked.context().Queue()
    child = forked.process(_run, (backend, str(tmp_path), queue))
    child.start()
    try:
        status, value = queue.get(timeout=600)
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    assert status == "ok", value
    biases = value["biases"]
    # GLM-4.5's MoE layers (the first is dense): each bias moved in every byte and the rollout holds it
    assert sorted(biases) == [f"model.layers.{i}.{BIAS}" for i in (1, 2)], biases
    assert all(b == {"every_byte_moved": True, "rollout_holds_the_trainers_bytes": True} for b in biases.values()), (
        biases
    )
    assert value["other_params_changed"] == []  # the rest of the model was re-written with its own bytes

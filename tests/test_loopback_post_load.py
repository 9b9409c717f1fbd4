"""The loopback runs SGLang's end-of-session post-processing, so CPU tests see derived tensors as a rollout holds them
(docs/architecture.md: derived tensors).

One loopback engine (TP2, SGLang's real DeepseekV3ForCausalLM ranks: MLA's `post_load_weights` derives w_kc / w_vc
from kv_b_proj) runs SGLang 0.5.21 or 0.5.23 (each test body runs in a process whose SGLang is that release, so the
ranks' model classes and session-end code are that release's), with weight-update sessions. A real sync
(SyncLifecycle, Mooncake tcp writes of MirrorPush: every parameter x 2) leaves w_kc / w_vc stale until
`/end_weight_update` re-runs the model's post-processing; after it they equal what SGLang's own loader derives from
the new weights (its start-up load of the same checkpoint, x 2: the derivation is reshape/transpose, exact under a
power-of-two scale). The same with a 128x128 block-FP8 checkpoint (the trainer's quantizer wrote it): `w_kc`/`w_vc`
come from kv_b_proj dequantized with its scales at session end, as SGLang's FP8 load derives them; x 2 keeps the
e4m3 bytes and doubles the scales, so after end they are exactly x 2 too. Since x 2 keeps the e4m3 bytes, the FP8
ranks' parameters are first made random (SGLang's weights_checker `reset_tensors`): an FP8 weight the push did not
write, or a w_kc/w_vc derived from bytes it did not write, then fails.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from verl_p2p.config import P2PConfig
from verl_p2p.loopback.engine import EngineSpec, loopback_engines
from verl_p2p.loopback.mirror_push import MirrorPush, scaled
from verl_p2p.planning.targets import TargetRank
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.client import SGLangClient
from verl_p2p.rollout.lifecycle import SyncLifecycle
from verl_p2p.sandbox.tiny import write_tiny_checkpoint
from verl_p2p.trainer.fp8_checkpoint import quantize_checkpoint

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytestmark = pytest.mark.slow

CONFIG = P2PConfig(protocol="tcp", hostname="127.0.0.1", p2p_transfer_timeout=10.0, http_timeout=60.0)
MLA = tuple(f"model.layers.{i}.self_attn.{w}" for i in range(3) for w in ("w_kc", "w_vc"))
SCALES = tuple(f"model.layers.{i}.self_attn.w_scale" for i in range(3))


def _bf16_mla_checkpoint(path):
    from test_fp8_plan import MLA_128  # every TP shard a multiple of 128: SGLang's block-FP8 rule

    return write_tiny_checkpoint(
        path, "deepseek_v3", id_encoded=False, dtype=torch.bfloat16, torch_dtype="bfloat16", **MLA_128
    )


def _run_under(version: str, call: str) -> None:
    """Run `call` (a function of this module, as source) in a process whose SGLang is `version`: the loopback's
    ranks inherit it, so they run that release's model classes and session-end code, not the venv's 0.5.12."""
    import subprocess
    import sys

    from support import replica_harness as harness

    code = f"import sys; sys.path.insert(0, 'tests'); import test_loopback_post_load as t; t.{call}"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=harness.version_env(version), capture_output=True, text=True,
        timeout=900, cwd=os.fspath(harness.REPO),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("version", ["0.5.21", "0.5.23"])
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_session_end_rebuilds_mla_derived_tensors_as_sglang_loads_them(tmp_path, weights, version):
    _run_under(version, f"_mla_session_end({str(tmp_path)!r}, {weights!r}, {version!r})")


def _mla_session_end(tmp: str, weights: str, version: str) -> None:
    """The test's body, in a process of SGLang `version` (asserts raise there)."""
    import sglang

    assert sglang.__version__ == version
    tmp_path = __import__("pathlib").Path(tmp)
    if weights == "bf16":
        model = write_tiny_checkpoint(tmp_path / "dsv3", "deepseek_v3", id_encoded=False)
    else:
        model = quantize_checkpoint(_bf16_mla_checkpoint(tmp_path / "dsv3-bf16"), tmp_path / "dsv3-fp8")
    dtype = "float32" if weights == "bf16" else "bfloat16"  # SGLang's FP8 method: bf16 activations and the rest
    spec = EngineSpec(tp=2, sglang_version=version, rank_timeout_s=120, dtype=dtype)
    with loopback_engines([spec], str(model)) as engines:
        engine = engines[0]
        loaded = [engine.dump_derived(r) for r in range(2)]  # SGLang's loader, post_load_weights included
        for held in loaded:
            assert set(MLA) <= set(held)
        if weights == "fp8":  # the rank holds the checkpoint's e4m3 bytes and block scales
            params = engine.dump(0)
            assert params["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
            assert params["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"].dtype == torch.float32
        mirror = MirrorPush.of_engines(engines, timeout_s=10.0)
        if weights == "fp8":
            # x 2 keeps the e4m3 bytes (only the block scales double), so a rank that never got its FP8 weights
            # written would still match: every parameter is made random first, then the push must write them all
            asyncio.run(_reset_tensors(engine.url))
            for rank in range(2):
                held = engine.dump(rank)
                fp8 = [n for n, t in mirror.witness[TargetRank(0, rank)].items() if t.dtype == torch.float8_e4m3fn]
                assert "model.layers.0.self_attn.kv_b_proj.weight" in fp8
                assert all(not torch.equal(held[n], mirror.witness[TargetRank(0, rank)][n]) for n in fp8)
        stale: list[dict] = []
        mirror.after_write = lambda: stale.extend(engine.dump_derived(r) for r in range(2))  # inside the session
        lifecycle = SyncLifecycle([P2PReplicaAdapter(0, engine.url, config=CONFIG)], CONFIG)
        try:
            report = asyncio.run(lifecycle.sync(1, mirror.push(2.0)))
            assert report.engines_without_sessions == []
            assert mirror.mismatches(2.0) == []  # every published parameter holds the new bytes
            # on a CPU rank SGLang keeps an FP8 kv_b_proj's w_kc/w_vc in e4m3 with one per-tensor scale w_scale
            # (block_quant_to_tensor_quant; a CUDA rank dequantizes to bf16): x 2 keeps the bytes, doubles w_scale
            names = MLA + (SCALES if weights == "fp8" else ())
            for rank in range(2):
                before, after = stale[rank], engine.dump_derived(rank)
                for name in names:
                    assert torch.equal(before[name], loaded[rank][name]), f"{name} changed before end"
                    want = scaled(loaded[rank][name], 2.0)
                    got = after[name]
                    assert got.dtype == want.dtype and torch.equal(
                        got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
                    ), f"rank {rank} {name} after end"
                if weights == "fp8":
                    assert {after[n].dtype for n in MLA} == {torch.float8_e4m3fn}
                    assert all(not torch.equal(after[n], before[n]) for n in SCALES)  # rebuilt at end
            ends = [e for e in engine.events() if e["path"] == "/end_weight_update"]
            assert ends and "post_load_weights ran" in ends[-1]["message"]
        finally:
            lifecycle.close()
            mirror.close()


async def _reset_tensors(url: str) -> None:
    """SGLang's weights_checker `reset_tensors`: every parameter and persistent buffer random (derived tensors that
    are neither, such as w_kc / w_vc, keep what the load derived)."""
    client = SGLangClient(url, timeout=60)
    try:
        await client.weights_checker("reset_tensors")
    finally:
        client.close()


def _gemma_session_end(model: str, version: str) -> dict:
    """In a process whose SGLang is `version` (its ranks inherit it): load, sync x 2, end the session; the facts."""
    import sglang

    spec = EngineSpec(tp=1, sglang_version=version, rank_timeout_s=120, dtype="bfloat16")
    with loopback_engines([spec], model) as engines:
        engine = engines[0]
        loaded, params = engine.dump_derived(0), engine.dump(0)
        gemma = sorted(n for n in loaded if n.endswith(".gemma_weight"))
        mirror = MirrorPush.of_engines(engines, timeout_s=10.0)
        lifecycle = SyncLifecycle([P2PReplicaAdapter(0, engine.url, config=CONFIG)], CONFIG)
        try:
            asyncio.run(lifecycle.sync(1, mirror.push(2.0)))
            after, written = engine.dump_derived(0), engine.dump(0)
            weight = {n: n.replace(".gemma_weight", ".weight") for n in gemma}
            return {
                "sglang": sglang.__version__,
                "gemma": gemma,
                "loaded_is_weight_plus_1": all(torch.equal(loaded[n], params[weight[n]] + 1) for n in gemma),
                "mismatches": mirror.mismatches(2.0),
                "ended": any(e["path"] == "/end_weight_update" for e in engine.events()),
                "unchanged_at_end": [n for n in gemma if torch.equal(after[n], loaded[n])],
                "equal_new_weight_plus_1": [n for n in gemma if torch.equal(after[n], written[weight[n]] + 1)],
            }
        finally:
            lifecycle.close()
            mirror.close()


@pytest.mark.parametrize("version", ["0.5.21", "0.5.23"])
def test_session_end_leaves_gemma_norm_weights_stale_the_evidence_behind_refusing_qwen3_next(tmp_path, version):
    """Why Qwen3-Next is refused (replica/derived.py NOT_REBUILT), shown by SGLang itself: its GemmaRMSNorm keeps a
    buffer gemma_weight = weight + 1 that the norm's weight loader computes. After a sync writes every parameter
    x 2 and /end_weight_update runs SGLang's session-end post-processing (the ranks run that release's classes),
    each norm weight is doubled but its gemma_weight still holds the loaded weight + 1: stale norms."""
    import json
    import subprocess
    import sys

    from support import replica_harness as harness

    model = write_tiny_checkpoint(tmp_path / "next", "qwen3_next", id_encoded=False, dtype=torch.bfloat16)
    code = (
        "import json, sys; sys.path.insert(0, 'tests'); from test_loopback_post_load import _gemma_session_end; "
        f"print('RESULT ' + json.dumps(_gemma_session_end({str(model)!r}, {version!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=harness.version_env(version), capture_output=True, text=True,
        timeout=600, cwd=os.fspath(harness.REPO),
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT ") :])
    assert got["sglang"] == version  # the ranks' model classes are that release's
    assert len(got["gemma"]) >= 4 and "model.layers.0.input_layernorm.gemma_weight" in got["gemma"]
    assert got["loaded_is_weight_plus_1"] and got["mismatches"] == [] and got["ended"]
    assert got["unchanged_at_end"] == got["gemma"] and got["equal_new_weight_plus_1"] == []

"""The loopback runs SGLang's end-of-session post-processing, so CPU tests see derived tensors as a rollout
holds them (docs/architecture.md: derived tensors).

One loopback engine (TP2, SGLang's real DeepseekV3ForCausalLM ranks: MLA's `post_load_weights` derives
w_kc / w_vc from kv_b_proj) claims SGLang 0.5.23, so it has weight-update sessions. A real sync (SyncLifecycle,
Mooncake tcp writes of MirrorPush: every parameter x 2) leaves w_kc / w_vc stale until `/end_weight_update`
re-runs the model's post-processing; after it they equal what SGLang's own loader derives from the new weights
(its start-up load of the same checkpoint, x 2: the derivation is reshape/transpose, exact under a power-of-two
scale).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from verl_p2p.config import P2PConfig
from verl_p2p.loopback.engine import EngineSpec, loopback_engines
from verl_p2p.loopback.mirror_push import MirrorPush
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.lifecycle import SyncLifecycle
from verl_p2p.sandbox.tiny import write_tiny_checkpoint

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytestmark = pytest.mark.slow

CONFIG = P2PConfig(protocol="tcp", hostname="127.0.0.1", p2p_transfer_timeout=10.0, http_timeout=60.0)
MLA = tuple(f"model.layers.{i}.self_attn.{w}" for i in range(3) for w in ("w_kc", "w_vc"))


def test_session_end_rebuilds_mla_derived_tensors_as_sglang_loads_them(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "dsv3", "deepseek_v3", id_encoded=False)
    spec = EngineSpec(tp=2, sglang_version="0.5.23", rank_timeout_s=60)
    with loopback_engines([spec], str(model)) as engines:
        engine = engines[0]
        loaded = [engine.dump_derived(r) for r in range(2)]  # SGLang's loader, post_load_weights included
        for held in loaded:
            assert set(MLA) <= set(held)
        mirror = MirrorPush.of_engines(engines, timeout_s=10.0)
        stale: list[dict] = []
        mirror.after_write = lambda: stale.extend(engine.dump_derived(r) for r in range(2))  # inside the session
        lifecycle = SyncLifecycle([P2PReplicaAdapter(0, engine.url, config=CONFIG)], CONFIG)
        try:
            report = asyncio.run(lifecycle.sync(1, mirror.push(2.0)))
            assert report.engines_without_sessions == []
            assert mirror.mismatches(2.0) == []  # every published parameter holds the new bytes
            for rank in range(2):
                before, after = stale[rank], engine.dump_derived(rank)
                for name in MLA:
                    assert torch.equal(before[name], loaded[rank][name]), f"{name} changed before end"
                    assert torch.equal(after[name], loaded[rank][name] * 2.0), f"rank {rank} {name} after end"
            ends = [e for e in engine.events() if e["path"] == "/end_weight_update"]
            assert ends and "post_load_weights ran" in ends[-1]["message"]
        finally:
            lifecycle.close()
            mirror.close()

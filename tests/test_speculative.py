"""A rollout running speculative decoding with a draft model is refused at launch and at connect, before any write.

Its draft's model runner publishes its transfer-engine table under the bare tp_rank after the target's, so the
rank info describes the draft (SGLang PR #35312 keys that table by (worker, tp_rank); open, not in 0.5.23). The
loopback engine is launched with `speculative_algorithm` in SGLang's own ServerArgs, so `/server_info` reports it
as a real server does; the connect refusals run on that answer, through the manager's server check and through
the sync lifecycle's connect step, and the engine's weights and call log show nothing was written.
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
import torch
from verl.workers.config import CheckpointEngineConfig, MtpConfig, RolloutConfig

from verl_p2p.backend.guards import MAIN_PPO, config_problems
from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PConfigError, UnsupportedLayoutError
from verl_p2p.loopback.engine import EngineSpec, loopback_engines
from verl_p2p.planning.layout import SPECULATIVE, check_reproducible, speculative_problem
from verl_p2p.rollout import launch
from verl_p2p.rollout.adapter import P2PReplicaAdapter
from verl_p2p.rollout.lifecycle import SyncError, SyncLifecycle
from verl_p2p.sandbox.tiny import write_tiny_checkpoint

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

PR = "SGLang PR #35312"
CONFIG = P2PConfig(protocol="tcp", hostname="127.0.0.1", p2p_transfer_timeout=3.0, http_timeout=20.0)
SGLANG = "actor_rollout_ref.rollout.engine_kwargs.sglang."


# ---- the rule ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "NEXTN", "STANDALONE"])
def test_every_draft_model_algorithm_is_refused_naming_the_pr_and_what_lifts_it(algorithm):
    problem = speculative_problem({SPECULATIVE: algorithm})
    assert problem is not None and f"{SPECULATIVE}={algorithm!r}" in problem
    assert PR in problem and "(worker, tp_rank)" in problem and "The refusal lifts" in problem
    with pytest.raises(UnsupportedLayoutError, match="#35312"):
        check_reproducible({"tp_size": 1, SPECULATIVE: algorithm})


@pytest.mark.parametrize("algorithm", [None, "NGRAM", "ngram"])
def test_no_speculation_or_a_draftless_one_is_accepted(algorithm):
    assert speculative_problem({SPECULATIVE: algorithm}) is None
    check_reproducible({"tp_size": 1, SPECULATIVE: algorithm})


# ---- launch -----------------------------------------------------------------------------------------------------


def test_launch_guards_refuse_the_server_arg_and_verls_mtp_rollout():
    from support.compose import OVERLAY, compose_config

    def problems(*overrides: str) -> list[str]:
        cfg = compose_config(
            "verl.trainer.main_ppo",
            ["--config-name=ppo_megatron_trainer", *OVERLAY, "trainer.v1.trainer_mode=separate_async", *overrides],
        )
        return config_problems(cfg, MAIN_PPO)

    assert problems() == []
    (arg,) = problems(f"+{SGLANG}{SPECULATIVE}=EAGLE")
    assert PR in arg and f"drop {SGLANG}{SPECULATIVE}" in arg
    (mtp,) = problems("actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_rollout=true")
    assert PR in mtp and "actor_rollout_ref.model.mtp.enable_rollout=false" in mtp


def test_replica_launch_refuses_before_the_server_starts():
    def replica(mtp=None, **sglang):
        config = RolloutConfig(
            name="sglang",
            engine_kwargs={"sglang": {**launch.p2p_server_args(7000), **sglang}},
            checkpoint_engine=CheckpointEngineConfig(backend="verl_p2p"),
            mtp=mtp,
        )
        return SimpleNamespace(config=config, replica_rank=0, rollout_mode=None)

    with pytest.raises(P2PConfigError, match="#35312"):
        launch.apply_to_replica(replica(**{SPECULATIVE: "EAGLE3"}))
    mtp = MtpConfig(enable=True, enable_rollout=True, speculative_algorithm="EAGLE")
    with pytest.raises(P2PConfigError, match="mtp.enable_rollout=false"):
        launch.apply_to_replica(replica(mtp=mtp))
    accepted = replica(**{SPECULATIVE: "NGRAM"})
    launch.apply_to_replica(accepted)
    assert accepted.config.engine_kwargs["sglang"][SPECULATIVE] == "NGRAM"


# ---- connect, on a loopback engine launched with the server arg ------------------------------------------------


@pytest.fixture(scope="module")
def speculative_engine(tmp_path_factory):
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("speculative") / "qwen3", "qwen3", id_encoded=False)
    spec = EngineSpec(tp=1, sglang_version="0.5.23", rank_timeout_s=10, server_args_overrides={SPECULATIVE: "EAGLE"})
    with loopback_engines([spec], str(model)) as (engine,):
        yield engine


@pytest.mark.slow
def test_a_speculative_rollout_is_refused_at_connect_before_any_write(speculative_engine):
    engine = speculative_engine
    before = engine.dump(0)
    adapter = P2PReplicaAdapter(0, engine.url, config=CONFIG)
    info = asyncio.run(adapter.server_info(refresh=True))
    assert info[SPECULATIVE] == "EAGLE"  # SGLang's ServerArgs resolved it; the server reports it
    with pytest.raises(UnsupportedLayoutError, match=r"rollout engine 0 .*speculative_algorithm='EAGLE'.*#35312"):
        launch.check_live_server_args(info, engine=0, url=engine.url)  # the manager's and the leader's check

    pushed = []

    async def push(connection):
        pushed.append(connection)
        return {}

    lifecycle = SyncLifecycle([P2PReplicaAdapter(0, engine.url, config=CONFIG)], CONFIG, frees_kv=False)
    try:
        with pytest.raises(SyncError) as caught:
            asyncio.run(lifecycle.sync(1, push))
    finally:
        lifecycle.close()
    assert "#35312" in str(caught.value) and pushed == []  # refused at connect: the push never ran
    after = engine.dump(0)
    assert after.keys() == before.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert "/update_weight_version" not in [e["path"] for e in engine.events() if e["method"] == "POST"]
    assert engine.state()["weight_version"] == "default" and engine.violations() == []

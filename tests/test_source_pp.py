"""A PP=2 Megatron trainer through the real SourceSession: each stage exports only its layers (PP-local) and
writes only the rollout parameters those tensors feed, to every target; together the stages fill every byte of
every rank (TP2/EP2 and TP2/EP1 receivers over real Mooncake tcp), each byte once."""

from __future__ import annotations

import os

import pytest
import torch
from support.pp_source import ENGINES, push_stage

from verl_p2p.planning.targets import TargetRank
from verl_p2p.sandbox.cpu_megatron import run_group

pytestmark = pytest.mark.slow
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def test_pp2_trainer_writes_every_byte_of_every_rank_once(tmp_path):
    from safetensors.torch import load_file

    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica import RankReplica
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.sandbox.tiny import tiny_config_dict, write_tiny_checkpoint
    from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint
    from verl_p2p.transfer.receiver import spec_from_plan, start_receivers, stop_all

    install_cpu_stubs()
    model_dir = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_moe")  # id-encoded float32
    cfg, specs = tiny_config_dict("qwen3_moe"), hf_specs_from_checkpoint(model_dir)
    replicas = {
        TargetRank(e, r): RankReplica.build(cfg, sa, layout_from_server_args(sa, r), specs)
        for e, sa in ENGINES.items()
        for r in range(sa["tp_size"])
    }
    handles = start_receivers({f"{t.engine}.{t.rank}": spec_from_plan(rep.plan.params) for t, rep in replicas.items()})
    try:
        receivers = {t: handles[f"{t.engine}.{t.rank}"] for t in replicas}
        infos = {t: h.remote_info() for t, h in receivers.items()}
        results = run_group(push_stage, 2, str(model_dir), infos, timeout_s=400)

        assert sorted(r["stage"] for r in results) == [0, 1]
        for t, replica in replicas.items():
            per_stage = [r["bytes"][(t.engine, t.rank)] for r in results]
            assert all(n > 0 for n in per_stage), f"{t}: a stage wrote nothing: {per_stage}"
            assert sum(per_stage) == replica.plan.nbytes, (
                f"{t}: stages wrote {per_stage}, rank holds {replica.plan.nbytes}"
            )

        hf = load_file(str(model_dir / "model.safetensors"))
        for t, replica in replicas.items():
            got = receivers[t].dump(str(tmp_path / f"{t.engine}{t.rank}.pt"))
            for name, p in replica.plan.params.items():
                want = torch.full((p.nbytes,), 0xFF, dtype=torch.uint8)
                replica.load(name, {f: hf[f] for f in p.feeds}, want)
                assert torch.equal(got[name], want), f"{t} {name}: bytes differ"
    finally:
        stop_all(handles.values())

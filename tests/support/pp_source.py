"""One rank of a PP=2 trainer (spawned by `run_group`): a Megatron-Bridge model of its stage, the p2p
SourceSession, this rank's assignment (computed the same way on every rank), one push."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ENGINES = {0: {"tp_size": 2, "ep_size": 2, "dtype": "float32"}, 1: {"tp_size": 2, "ep_size": 1, "dtype": "float32"}}


def push_stage(rank: int, world: int, port: int, model_dir: str, rank_infos: dict) -> dict[str, Any]:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from verl_p2p.backend.topology import SourceMeta, assign
    from verl_p2p.cli.demo import trainer_engine
    from verl_p2p.config import P2PConfig
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.sandbox.cpu_megatron import Parallel, init_distributed
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.trainer.source import SourceSession

    install_cpu_stubs()
    init_distributed(rank, world, port)
    engine = trainer_engine(Path(model_dir), Parallel(pp=2))
    config = P2PConfig(protocol="tcp", hostname="127.0.0.1", bucket_size_mb=1, p2p_transfer_timeout=30.0)
    session = SourceSession(config, engine, hostname="127.0.0.1")
    layouts = {t: layout_from_server_args(ENGINES[t.engine], t.rank) for t in rank_infos}
    sources = [SourceMeta(rank=r, pp_stage=r, pp_size=2) for r in range(world)]  # PP=2, TP=1: rank r is stage r
    assignment = assign(sources, ENGINES, rank_infos, layouts, generation=1)[rank]
    session.apply(assignment)
    metrics = session.push()
    session.close()
    return {"stage": assignment.pp_stage, "bytes": {(t.engine, t.rank): n for t, n in metrics.bytes_per_target.items()}}

"""One rank of a TP=2 trainer (spawned by `run_group`) whose peer fails: a tiny Megatron-Bridge model, the real
SourceSession, and after each push the outcome exchange every trainer rank makes in `send_weights` (an
all_gather over all trainer ranks), so a rank that raised early waits there as it would in verl.

Two syncs, each to its own set of receivers: (1) the bad rank's target publishes a wrong size, so its
validation fails before the export; (2) the bad rank's export yields one tensor of another dtype mid-stream, so
its push fails while streaming.
Each rank reports per sync how long push + outcome exchange took and what it raised.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

ENGINES = {0: {"tp_size": 1, "ep_size": 1, "dtype": "float32"}, 1: {"tp_size": 1, "ep_size": 1, "dtype": "float32"}}


def _local_only_go_no_go(rank: int, ranks: Any, error: BaseException | None, stream_digest: Any = None) -> None:
    """What the push did before the go/no-go existed: a rank raises its own error, the others go on."""
    if error is not None:
        raise error


def push_with_a_failing_peer(
    rank: int,
    world: int,
    port: int,
    model_dir: str,
    infos: tuple[dict, dict],
    bad_rank: int,
    go_no_go: bool = True,
) -> list[dict[str, Any]]:
    """`go_no_go=False` replaces the go/no-go by a local raise, to show the hang it prevents (not used by CI)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    import torch
    import torch.distributed as dist

    from verl_p2p.backend.topology import SourceMeta, assign
    from verl_p2p.cli.demo import trainer_engine
    from verl_p2p.config import P2PConfig
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo
    from verl_p2p.sandbox.cpu_megatron import Parallel, init_distributed
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.trainer import senders
    from verl_p2p.trainer.source import SourceSession

    install_cpu_stubs()
    init_distributed(rank, world, port, timeout_s=60)  # a hang ends as a gloo timeout after 60 s
    if not go_no_go:
        senders.agree_to_export = _local_only_go_no_go
    engine = trainer_engine(Path(model_dir), Parallel(tp=2))
    outcome_group = dist.new_group(backend="gloo")  # what P2PCheckpointEngine._gather uses
    config = P2PConfig(protocol="tcp", hostname="127.0.0.1", bucket_size_mb=1, p2p_transfer_timeout=30.0)
    session = SourceSession(config, engine, hostname="127.0.0.1")
    layouts = {t: layout_from_server_args(ENGINES[t.engine], t.rank) for t in infos[0]}
    sources = [SourceMeta(rank=r, pp_stage=0) for r in range(world)]  # TP=2: one stage, both ranks senders

    def sync(assignment) -> dict[str, Any]:
        session.apply(assignment)
        t0 = time.monotonic()
        error = None
        try:
            session.push()
        except Exception as exc:
            error = exc
        outcomes: list[Any] = [None] * world
        dist.all_gather_object(
            outcomes, (rank, None if error is None else f"{type(error).__name__}: {error}"), group=outcome_group
        )
        return {
            "rank": rank,
            "seconds": time.monotonic() - t0,
            "error_type": None if error is None else type(error).__name__,
            "error": None if error is None else str(error),
            "failed_ranks": sorted(r for r, why in outcomes if why),
        }

    results = []
    # (1) validation: the bad rank's target publishes one parameter with a wrong numel
    good = assign(sources, ENGINES, infos[0], layouts, generation=1)[rank]
    assert good.targets, f"rank {rank} has no target: the test needs both ranks to be senders"
    mine = good
    if rank == bad_rank:
        (target,) = good.targets
        info = good.rank_infos[target]
        name = sorted(info.params)[0]
        p = info.params[name]
        wrong = {**info.params, name: RemoteParam(p.address, p.numel + 1, p.element_size)}
        mine = dataclasses.replace(good, rank_infos={target: RemoteRankInfo(info.session_id, wrong)})
    results.append(sync(mine))

    # (2) streaming: the bad rank's export yields its 5th tensor as int32
    if rank == bad_rank:
        original = session.stream

        def one_bad_tensor(*args, **kwargs):  # push hands `stream` verl's generator (FSDP's stream)
            for i, (name, tensor) in enumerate(original(*args, **kwargs)):
                yield name, (tensor.to(torch.int32) if i == 4 else tensor)

        session.stream = one_bad_tensor
    results.append(sync(assign(sources, ENGINES, infos[1], layouts, generation=2)[rank]))
    session.close()
    return results

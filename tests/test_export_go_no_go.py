"""No hang on one rank's error: two TP ranks of a real Megatron-Bridge model (gloo processes), both senders through
the real SourceSession into real Mooncake receivers. When one rank's validation fails, the export group's
go/no-go makes both ranks raise within seconds, naming the failed rank and its cause, and nothing is written.
When one rank's push fails mid-stream, it drains the export so its peer's TP gathers complete, and both ranks
return within seconds. (Without the go/no-go the healthy rank waits in the export's TP gather while the failed
one waits in the outcome exchange, until the process group times out.)"""

from __future__ import annotations

import os

import pytest
import torch
from support.go_no_go import ENGINES, push_with_a_failing_peer

from verl_p2p.planning.targets import TargetRank
from verl_p2p.sandbox.cpu_megatron import run_group

pytestmark = pytest.mark.slow
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

RETURN_WITHIN_S = 10.0
BAD = 1


def test_one_ranks_failure_returns_every_rank_of_the_export_group_within_seconds(tmp_path):
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica import RankReplica
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.sandbox.tiny import tiny_config_dict, write_tiny_checkpoint
    from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint
    from verl_p2p.transfer.receiver import FILL_BYTE, spec_from_plan, start_receivers, stop_all

    install_cpu_stubs()
    model_dir = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3")
    cfg, specs = tiny_config_dict("qwen3"), hf_specs_from_checkpoint(model_dir)
    replicas = {
        TargetRank(e, 0): RankReplica.build(cfg, sa, layout_from_server_args(sa, 0), specs) for e, sa in ENGINES.items()
    }
    spec = {t: spec_from_plan(rep.plan.params) for t, rep in replicas.items()}
    handles = start_receivers({f"{sync}.{t.engine}": spec[t] for sync in (1, 2) for t in replicas})
    try:
        receivers = [{t: handles[f"{sync}.{t.engine}"] for t in replicas} for sync in (1, 2)]
        infos = tuple({t: h.remote_info() for t, h in r.items()} for r in receivers)
        results = run_group(push_with_a_failing_peer, 2, str(model_dir), infos, BAD, timeout_s=400)
        validation, streaming = zip(*results, strict=True)

        def written(sync: int) -> list[TargetRank]:
            return [
                t
                for t, h in receivers[sync].items()
                if not all(
                    bool((b == FILL_BYTE).all()) for b in h.dump(str(tmp_path / f"{sync}{t.engine}.pt")).values()
                )
            ]

        # (1) validation failed on rank 1: both ranks raise the go/no-go's error, naming rank 1 and the cause
        for outcome in validation:
            assert outcome["seconds"] < RETURN_WITHIN_S, f"rank {outcome['rank']} took {outcome['seconds']:.1f} s"
            assert outcome["error_type"] == "ExportAbortedError", outcome
            assert f"trainer rank {BAD}: RemoteMismatchError" in outcome["error"]
            assert "trainer rank 0:" not in outcome["error"]  # rank 0 was ready: only rank 1 is named
            assert "nothing was written" in outcome["error"] and "numel" in outcome["error"]
            assert outcome["failed_ranks"] == [0, 1]
        assert written(0) == []  # the healthy rank did not write either: it never exported

        # (2) rank 1 refused a streamed tensor mid-stream: it drained the export, rank 0 finished its push
        by_rank = {o["rank"]: o for o in streaming}
        for outcome in streaming:
            assert outcome["seconds"] < RETURN_WITHIN_S, f"rank {outcome['rank']} took {outcome['seconds']:.1f} s"
            assert outcome["failed_ranks"] == [BAD]  # every rank learns who failed (the outcome exchange)
        assert by_rank[0]["error"] is None
        assert by_rank[BAD]["error_type"] == "StreamRefusedError"
        assert f"arrives as {torch.int32}" in by_rank[BAD]["error"]
        assert "bytes of these targets are now unknown" in by_rank[BAD]["error"]  # earlier tensors were written
        assert len(written(1)) == 2  # the healthy rank's target got its push; the bad rank's, its first tensors
    finally:
        stop_all(handles.values())

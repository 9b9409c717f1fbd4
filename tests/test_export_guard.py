"""The cross-stage collective guard itself: it must fire on every kind of call that leaves the stage.

Two real gloo processes, each its own "stage" ({0} and {1}); no Megatron needed, so this runs in seconds.
"""

from __future__ import annotations

import torch

from verl_p2p.sandbox.cpu_megatron import init_distributed, run_group


def _guard_cases(rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist

    from verl_p2p.trainer.stage_guard import CrossStageCollectiveError, stage_collective_guard

    init_distributed(rank, world, port)
    solo = [dist.new_group([r]) for r in range(world)]  # every rank must create every group
    both = dist.new_group([0, 1])
    other = 1 - rank
    out: dict = {"fired": {}, "recorded": None, "restored": None}

    calls = {
        "broadcast_world": lambda: dist.broadcast(torch.zeros(2), src=0),
        "all_reduce_group": lambda: dist.all_reduce(torch.zeros(2), group=both),
        "all_gather_positional_group": lambda: dist.all_gather([torch.zeros(1)] * 2, torch.zeros(1), both),
        "all_gather_object": lambda: dist.all_gather_object([None, None], rank),
        "broadcast_object_list": lambda: dist.broadcast_object_list([rank], src=0, group=both),
        "send": lambda: dist.send(torch.zeros(1), dst=other),
        "irecv": lambda: dist.irecv(torch.zeros(1), src=other),
        "batch_isend_irecv": lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.zeros(1), other)]),
        "barrier": lambda: dist.barrier(),
        "c10d_namespace": lambda: dist.distributed_c10d.all_reduce(torch.zeros(1)),
    }
    for label, call in calls.items():
        try:
            with stage_collective_guard([rank]):
                call()
            out["fired"][label] = ""
        except CrossStageCollectiveError as err:
            out["fired"][label] = str(err)

    # in-stage calls run and are recorded once each (the object collective's inner calls are not re-recorded)
    with stage_collective_guard([rank]) as log:
        t = torch.ones(3)
        dist.all_reduce(t, group=solo[rank])
        got: list = [None]
        dist.all_gather_object(got, {"r": rank}, group=solo[rank])
    out["recorded"] = [(c.op, c.ranks) for c in log.calls]
    out["value_ok"] = bool(torch.equal(t, torch.ones(3))) and got == [{"r": rank}]
    out["restored"] = not hasattr(dist.broadcast, "__p2p_guard_original__")
    dist.barrier()  # unguarded again: a world barrier must work
    dist.destroy_process_group()
    return out


def test_guard_fires_on_every_cross_stage_call_and_records_in_stage_ones():
    results = run_group(_guard_cases, 2, timeout_s=120)
    for rank, res in enumerate(results):
        not_fired = [label for label, msg in res["fired"].items() if not msg]
        assert not not_fired, f"rank {rank}: guard let these cross-stage calls through: {not_fired}"
        assert all(f"outside this pipeline stage [{rank}]" in msg for msg in res["fired"].values())
        assert res["recorded"] == [("all_reduce", (rank,)), ("all_gather_object", (rank,))]
        assert res["value_ok"] and res["restored"]

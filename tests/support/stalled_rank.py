"""Trainer ranks of one stage in a real gloo world whose rank 2 dies (SIGKILL) or stalls (SIGSTOP) after a sync
(tests/test_stalled_rank_go_no_go.py). Real: torch.distributed (gloo), the processes and signals, `assign` and
`agree_to_export`. The export itself is not run here (the go/no-go is the step every push runs first).

TP2 x DP2: ranks {0, 1} and {2, 3} each export together (their `export_peers`), the two pairs are data-parallel
copies of the stage. Each rank reports (step, outcome, seconds) on the queue.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from typing import Any

WORLD, VICTIM = 4, 2
PEERS = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
ARGS = {"tp_size": 1, "dtype": "float32"}


def plan(unreachable: tuple[int, ...] = (), generation: int = 1) -> dict[int, Any]:
    from verl_p2p.backend.topology import SourceMeta, assign
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo, TargetRank

    targets = [TargetRank(e, 0) for e in range(WORLD)]
    infos = {t: RemoteRankInfo(f"127.0.0.1:{1000 + t.engine}", {"w": RemoteParam(4096, 4, 4)}) for t in targets}
    layouts = {t: layout_from_server_args(ARGS, 0) for t in targets}
    sources = [SourceMeta(r, 0, export_peers=PEERS[r]) for r in range(WORLD)]
    servers = dict.fromkeys(range(WORLD), ARGS)
    return assign(sources, servers, infos, layouts, generation, unreachable=unreachable)


def rank_main(rank: int, port: int, fault: str, deadline_s: float, resumed: Any, out: Any) -> None:
    import torch.distributed as dist

    from verl_p2p.trainer.senders import agree_to_export

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip

    def step(name: str, assignment: Any, epoch: int) -> None:
        t0 = time.monotonic()
        try:
            if assignment.export:
                agree_to_export(rank, assignment.stage_ranks, None, timeout_s=deadline_s, epoch=epoch)
                outcome = f"passed over {list(assignment.stage_ranks)}"
            else:
                outcome = "skipped"
        except Exception as exc:  # noqa: BLE001 - reported
            outcome = f"{type(exc).__name__}: {exc}"
        out.put((rank, name, outcome, time.monotonic() - t0))

    full = plan()
    step("sync1", full[rank], 1)
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    step("sync2", full[rank], 2)  # the next sync with the old plan: the victim's stage waits for it
    step("repush", plan((VICTIM,), generation=2)[rank], 3)  # planned around the victim
    if fault == "stop":
        if rank != VICTIM:
            resumed.wait(120)
        step("sync3", plan(generation=3)[rank], 4)  # after SIGCONT: every rank again
    out.put((rank, "done", "", 0.0))

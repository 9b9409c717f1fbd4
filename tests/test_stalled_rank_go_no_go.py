"""R29: the go/no-go of a push waits at most `p2p_push_deadline_s` for a rank that died or stalls, and a re-push
planned around it runs without it. Four real gloo ranks of one stage (TP2 x DP2: tests/support/stalled_rank.py);
after sync 1, rank 2 is SIGKILLed or SIGSTOPped:

- the next go/no-go over the whole stage fails on every survivor within the deadline plus a margin (a killed
  peer: at once; before: a stopped peer held them for torch's default 30 minutes);
- the re-push's assignment (`unreachable=[2]`) skips rank 3 (its TP peer) entirely and runs the go/no-go among
  the data-parallel copy {0, 1} only, which passes;
- after SIGCONT, the next sync's go/no-go over all four ranks passes: the survivors' replacement group and the
  resumed rank's agree on its name (torch's hashed names would not).
"""

from __future__ import annotations

import time

import pytest
from support import stalled_rank
from support.fake_sglang import free_port

pytestmark = pytest.mark.slow

DEADLINE_S = 4.0
MARGIN_S = 3.0  # process scheduling on a busy 2-core host


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_survivors_stop_waiting_at_the_deadline_and_re_push_without_the_stalled_pair(fault):
    import os
    import signal

    from verl_p2p.sandbox import forked

    ctx = forked.context()
    out, resumed, port = ctx.Queue(), ctx.Event(), free_port()
    args = (port, fault, DEADLINE_S, resumed, out)
    procs = [forked.process(stalled_rank.rank_main, (r, *args), daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    survivors = [r for r in range(4) if r != stalled_rank.VICTIM]
    got: dict[tuple[int, str], tuple[str, float]] = {}
    try:

        def collect(keys: set, within: float) -> None:
            end = time.monotonic() + within
            while not keys <= set(got) and time.monotonic() < end:
                try:
                    rank, name, outcome, seconds = out.get(timeout=1)
                except Exception:  # noqa: BLE001 - queue.Empty: checked below
                    continue
                got[(rank, name)] = (outcome, seconds)
            assert keys <= set(got), f"no report from {sorted(keys - set(got))} (blocked?): {got}"

        collect({(r, "repush") for r in survivors}, 120)
        for r in survivors:
            outcome, seconds = got[(r, "sync2")]
            assert outcome.startswith("GroupBrokenError") and "[0, 1, 2, 3]" in outcome, (r, outcome)
            assert seconds < DEADLINE_S + MARGIN_S, f"rank {r} waited {seconds:.1f} s in the go/no-go"
        assert got[(3, "repush")][0] == "skipped"  # its TP peer is the victim: it does not export
        for r in (0, 1):
            outcome, seconds = got[(r, "repush")]
            assert outcome == "passed over [0, 1]", (r, outcome)
            assert seconds < MARGIN_S, (r, seconds)
        print({k: (o[:60], round(s, 2)) for k, (o, s) in sorted(got.items())})
        if fault == "stop":
            os.kill(procs[stalled_rank.VICTIM].pid, signal.SIGCONT)
            resumed.set()
            collect({(r, "done") for r in range(4)}, 60)
            for r in range(4):
                assert got[(r, "sync3")][0] == "passed over [0, 1, 2, 3]", (r, got[(r, "sync3")])
            print({k: (o[:60], round(s, 2)) for k, (o, s) in sorted(got.items()) if k[1] == "sync3"})
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(timeout=10)

"""A call to a dead peer over a multiprocessing pipe must leave nothing the garbage collector frees under itself.

What crashed `scripts/cost_growth.py` (SIGSEGV after "SystemError: deallocated BytesIO object has exported
buffers"): the e2e kill drill SIGKILLs the trainer process, and the sync's re-push then calls `apply` on it.
`Connection.send` wrote from a `getbuffer()` view of its pickler's BytesIO; the BrokenPipeError's traceback kept
that view, `TrainerDied` chained it, and asyncio's future and the sync's failure list held it in a reference cycle.
CPython 3.12.1's collector can clear the view's owner before the view (gh-111049): the BytesIO is freed under a live
view, and releasing the view then segfaults. Which object the collector clears first depends on the generations
the objects sit in, so the run crashed rarely; here the cycle's holder is made after the error, which puts the
BytesIO's buffer object first, every time. Each case runs in a child interpreter: the crash kills the process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TRAINER = """
import gc, sys
from verl_p2p.e2e.trainer import TrainerDied as Died, TrainerProcess, TrainerSpec

trainer = TrainerProcess(TrainerSpec(model_dir=sys.argv[1]))
trainer.kill()  # the kill drill: SIGKILL, then the re-push's `apply` goes to the dead process
call = lambda payload: trainer.call("apply", payload)
"""

# the loopback's handle on a rank: a live process whose end of the pipe is gone, which is what a rank that dies
# right after the handle's liveness check leaves (the process here sleeps: it never had the pipe)
RANK = """
import multiprocessing as mp, time
from verl_p2p.loopback.rank_worker import RankHandle, RankUnavailable as Died

ctx = mp.get_context("spawn")
parent, child = ctx.Pipe()
proc = ctx.Process(target=time.sleep, args=(30,), daemon=True)
proc.start()
child.close()
handle = RankHandle(0, proc, parent)
call = lambda payload: handle.call("weights_checker", 10, action="snapshot", payload=payload)
"""

COLLECT = """
gc.collect()
gc.disable()  # the one collection below decides, with the objects in the order they were made
try:
    call({"plan": b"x" * int(sys.argv[2])})
except Died as exc:
    held = [exc]  # what the future and the failure list do with it: a reference cycle, made after the error
    held.append(held)
    print("cause", type(exc.__cause__).__name__, flush=True)
del held
print("collected", gc.collect() > 0, flush=True)
"""


@pytest.mark.parametrize("caller", ["trainer", "rank"])
@pytest.mark.parametrize("payload", [12_000, 40_000], ids=["one-write", "header-then-payload"])
def test_a_call_to_a_dead_peer_survives_the_collection_of_its_error(tmp_path, caller, payload):
    """The e2e's trainer process and the loopback's rank, both of `Connection._send_bytes`'s paths: a pickle up to
    16 KiB is written with its header in one write, a larger one after it (then `_send`'s frame holds the view
    too). The drill's `apply` was 12.5 KB."""
    script = "import gc, sys\n" + {"trainer": TRAINER, "rank": RANK}[caller] + COLLECT
    out, err = tmp_path / "out", tmp_path / "err"  # files: a crashed child's sleeper would hold pipes open
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "no-model"), str(payload)],
            cwd=ROOT,
            stdout=o,
            stderr=e,
            timeout=120,
        )
    stdout, stderr = out.read_text(), err.read_text()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout}\n{stderr[-2000:]}"
    assert "cause BrokenPipeError" in stdout  # the write failed on the dead peer, as in the drill
    assert "collected True" in stdout  # the cycle holding the error was collected
    assert "exported buffers" not in stderr

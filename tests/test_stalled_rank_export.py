"""R29 with the real exports: a trainer rank SIGKILLed or SIGSTOPped inside its export stream (after a few
tensors), in real gloo worlds with the real `SourceSession` push (go/no-go, export, Mooncake tcp writes into
receiver processes prefilled with 0xFF). The test is the driver: it plans with `topology.assign` from the
`SourceMeta`s the ranks report (their `export_peers` read from the engine) and hands each rank its calls in order
(tests/support/stalled_export.py), as verl's driver does.

Which bound applies where:
- p2p's own groups (the go/no-go) time out after `p2p_push_deadline_s` (DEADLINE_S here);
- the export's gathers (Megatron's TP group) run on the trainer's own groups and keep the trainer's timeout
  (GROUP_TIMEOUT_S, set at init as a trainer sets it): p2p cannot shorten them (gloo closes a group for good on a
  timeout). A rank waiting there for a killed peer fails at once; for a stopped peer it waits until the peer
  resumes or that timeout passes. In the "stop" case the stop ends before it: a stall the training itself survives.

Megatron TP2 x DP2 (ranks {0, 1} and {2, 3} each export together): rank 2 is the victim. Ranks 0 and 1 return from
the push within the deadline plus MARGIN_S; the re-push planned by `assign(..., unreachable={2})` leaves ranks 2 and
3 out and writes their targets through the data-parallel copy {0, 1}, every byte what SGLang's loader holds from
the checkpoint. After the SIGSTOPped rank is SIGCONTed, the next full sync is exact. FSDP2, where no rank can
re-push around the victim (and a stop past the trainer's group timeout), is proven with the P2P manager as the
driver: tests/test_manager_stalled_export.py.

The Megatron "stop" case re-pushes the stopped pair's targets while the victim is still stopped. The P2P manager
itself keeps a late rank's targets out of that sync's re-push while its write may still be in flight (R30); here
the planner is driven directly, to show the data-parallel copy exports and writes without the stopped pair.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.fake_sglang import free_port
from support.stalled_export import Call, Trainer, serve

from verl_p2p.planning.targets import TargetRank

pytestmark = pytest.mark.slow
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

# p2p_push_deadline_s: a new gloo group of 4 ranks meets within it on a loaded 2-core host (4 s did not, at load 28)
DEADLINE_S = 8.0
GROUP_TIMEOUT_S = 20.0  # the trainer's own groups: longer than a "stop" lasts
MARGIN_S = 4.0  # process scheduling on a busy 2-core host
AFTER = 3  # tensors the victim streams before its signal
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


class Targets:
    """Rollout ranks (one engine each, TP1): receiver processes, and what SGLang's loader puts in each from the
    checkpoint (the replica's `load`, as tests/test_source_pp.py compares)."""

    def __init__(self, model_dir: Path, engines: int, root: Path) -> None:
        from safetensors.torch import load_file

        from verl_p2p.planning.layout import layout_from_server_args
        from verl_p2p.replica import RankReplica
        from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
        from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint
        from verl_p2p.transfer.receiver import spec_from_plan, start_receivers

        install_cpu_stubs()
        self.root = root
        self.servers = {e: {"tp_size": 1, "dtype": "float32"} for e in range(engines)}
        self.targets = [TargetRank(e, 0) for e in range(engines)]
        self.layouts = {t: layout_from_server_args(self.servers[t.engine], 0) for t in self.targets}
        cfg = json.loads((model_dir / "config.json").read_text())
        replica = RankReplica.build(
            cfg, self.servers[0], self.layouts[self.targets[0]], hf_specs_from_checkpoint(model_dir)
        )
        self.nbytes = replica.plan.nbytes
        hf = load_file(str(model_dir / "model.safetensors"))
        self.expected = {}
        for name, p in replica.plan.params.items():
            self.expected[name] = torch.full((p.nbytes,), 0xFF, dtype=torch.uint8)
            replica.load(name, {f: hf[f] for f in p.feeds}, self.expected[name])
        spec = spec_from_plan(replica.plan.params)
        handles = start_receivers({str(t.engine): spec for t in self.targets})
        self.receivers = {t: handles[str(t.engine)] for t in self.targets}
        self.infos = {t: h.remote_info() for t, h in self.receivers.items()}

    def plan(self, metas: list, generation: int, only: Any = None, unreachable: Any = ()) -> dict:
        from verl_p2p.backend.topology import assign

        targets = self.targets if only is None else sorted(only)
        infos = {t: self.infos[t] for t in targets}
        return assign(metas, self.servers, infos, self.layouts, generation, unreachable=unreachable)

    def fill(self) -> None:
        for h in self.receivers.values():
            h.fill()

    def wrong(self, tag: str) -> dict[str, list[str]]:
        """{target: names whose bytes differ from SGLang's load} (unwritten bytes are 0xFF: differ)."""
        out = {}
        for t, h in self.receivers.items():
            got = h.dump(str(self.root / f"{tag}{t.engine}.pt"))
            bad = [n for n, want in self.expected.items() if not torch.equal(got[n], want)]
            if bad:
                out[str(t)] = bad
        return out

    def close(self) -> None:
        from verl_p2p.transfer.receiver import stop_all

        stop_all(self.receivers.values())


class Ranks:
    """The trainer ranks, one inbox each: a call waits behind a rank that is busy or stopped, as Ray's do."""

    def __init__(self, trainer: Trainer) -> None:
        from verl_p2p.sandbox import forked

        ctx = forked.context()
        self.out = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(trainer.world)]
        self.procs = [
            forked.process(serve, (r, trainer, self.inboxes[r], self.out), daemon=True) for r in range(trainer.world)
        ]
        for p in self.procs:
            p.start()
        self.got: dict[tuple[int, str], tuple[str, float, dict, float]] = {}
        self.metas: dict[int, Any] = {}
        self._wait(lambda: len(self.metas) == trainer.world, 300, "every rank built")

    def call(self, calls: dict[int, Call]) -> float:
        for rank, c in calls.items():
            self.inboxes[rank].put(c)
        return time.monotonic()

    def collect(self, name: str, ranks: Any, within: float) -> dict[int, tuple[str, float, dict, float]]:
        """{rank: (outcome, push seconds, bytes per target, arrival time)} of call `name` on `ranks`."""
        keys = {(r, name) for r in ranks}
        self._wait(lambda: keys <= set(self.got), within, f"{name} from ranks {sorted(ranks)}")
        return {r: self.got[(r, name)] for r in ranks}

    def poll(self) -> None:
        """Take every report that has arrived, waiting for none."""
        self._wait(lambda: False, 0.5, "", waiting=False)

    def _wait(self, done: Any, within: float, what: str, waiting: bool = True) -> None:
        end = time.monotonic() + within
        while not done():
            try:
                msg = self.out.get(timeout=max(0.1, min(1.0, end - time.monotonic())))
            except Exception:  # noqa: BLE001 - queue.Empty
                if not waiting:
                    return
                assert time.monotonic() < end, f"no report of {what} within {within} s: {sorted(self.got)}"
                continue
            if msg[0] == "error":
                raise AssertionError(f"rank {msg[1]} failed:\n{msg[2]}")
            if msg[0] == "meta":
                self.metas[msg[1]] = msg[2]
            else:
                self.got[(msg[1], msg[2])] = (*msg[3:], time.monotonic())

    def sources(self) -> list:
        return [self.metas[r] for r in sorted(self.metas)]

    def signal(self, rank: int, sig: int) -> None:
        os.kill(self.procs[rank].pid, sig)

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=5)
        for p in self.procs:  # only the processes started here
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.join(timeout=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from verl_p2p.sandbox.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3", "qwen3")


def _trainer(kind: str, world: int, model_dir: Path) -> Trainer:
    return Trainer(kind, world, free_port(), str(model_dir), DEADLINE_S, GROUP_TIMEOUT_S)


def _full_sync(ranks: Ranks, rollout: Targets, name: str, generation: int) -> dict:
    """Every rank pushes every target (after a fill): each rank returns ok, every byte equals SGLang's load."""
    rollout.fill()
    plan = rollout.plan(ranks.sources(), generation)
    ranks.call({r: Call(name, a) for r, a in plan.items()})
    got = ranks.collect(name, plan, 240)
    assert all(o == "ok" for o, *_ in got.values()), got
    assert rollout.wrong(name) == {}
    return got


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_megatron_dp_copy_re_pushes_around_a_rank_killed_or_stopped_mid_export(fault, model_dir, tmp_path):
    victim, peer, survivors = 2, 3, (0, 1)
    rollout = Targets(model_dir, 4, tmp_path)
    ranks = Ranks(_trainer("megatron", 4, model_dir))
    try:
        metas = ranks.sources()
        assert [m.export_peers for m in metas] == [(0, 1), (0, 1), (2, 3), (2, 3)]  # read from Megatron's groups
        first = _full_sync(ranks, rollout, "sync1", 1)

        rollout.fill()
        plan = rollout.plan(metas, 2)
        lost = {t for r in (victim, peer) for t in plan[r].targets}  # what the victim's export group writes
        assert lost and not lost & {t for r in survivors for t in plan[r].targets}
        sent = ranks.call(
            {r: Call("sync2", a, (SIGNALS[fault], AFTER) if r == victim else None) for r, a in plan.items()}
        )
        returned = survivors + ((peer,) if fault == "kill" else ())
        second = ranks.collect("sync2", returned, 120)
        for r in survivors:  # their export shares no group with the victim
            outcome, seconds, written, _ = second[r]
            assert outcome == "ok", (r, outcome)
            assert seconds < DEADLINE_S + MARGIN_S, f"rank {r}: push took {seconds:.2f} s"
            assert sum(written.values()) == rollout.nbytes * len(plan[r].targets)
        if fault == "kill":  # its TP gather with a dead peer fails at once
            outcome, seconds, _, _ = second[peer]
            assert "Connection closed by peer" in outcome or "Connection reset" in outcome, outcome
            assert seconds < MARGIN_S, f"rank {peer}: {seconds:.2f} s"
        else:  # the driver's deadline passes; the peer is still in its TP gather with the stopped victim
            time.sleep(max(0.0, sent + DEADLINE_S - time.monotonic()))
            ranks.poll()
            assert (peer, "sync2") not in ranks.got  # bounded only by the trainer's group timeout

        repush = rollout.plan(metas, 3, only=lost, unreachable={victim})
        assert not repush[victim].export and not repush[peer].export
        assert {t for r in survivors for t in repush[r].targets} == lost
        assert all(repush[r].stage_ranks == survivors for r in survivors)
        ranks.call({r: Call("repush", a) for r, a in repush.items()})
        again = ranks.collect("repush", returned, 120)
        for r in survivors:
            outcome, seconds, written, _ = again[r]
            assert outcome == "ok", (r, outcome)
            assert seconds < DEADLINE_S + MARGIN_S, f"rank {r}: re-push took {seconds:.2f} s"
        assert sum(n for r in survivors for n in again[r][2].values()) == rollout.nbytes * len(lost)
        if fault == "kill":
            assert again[peer][0] == "skipped"
        assert rollout.wrong("repush") == {}  # the victim's targets, through the DP copy (the victim still stopped)
        report = {
            "sync1_s": {r: round(v[1], 2) for r, v in first.items()},
            "sync2_s": {r: round(v[1], 2) for r, v in second.items()},
            "repush_s": {r: round(v[1], 2) for r, v in again.items()},
        }

        if fault == "stop":
            stopped = time.monotonic() - sent
            ranks.signal(victim, signal.SIGCONT)
            late = ranks.collect("sync2", (victim, peer), GROUP_TIMEOUT_S)
            assert late[peer][0] == "ok", late  # the stop ended before the group timeout: the gathers completed
            # the victim finishes its stream too; a write it had in flight when stopped may have outlived
            # p2p_transfer_timeout meanwhile (a loaded host stops it longer): then that write fails, naming its target
            outcome = late[victim][0]
            assert outcome == "ok" or (outcome.startswith("TransferError") and "unknown" in outcome), late
            assert late[peer][1] > DEADLINE_S - 1, late  # it waited for the victim past p2p's deadline
            skipped = ranks.collect("repush", (victim, peer), 60)
            assert all(o == "skipped" for o, *_ in skipped.values()), skipped
            third = _full_sync(ranks, rollout, "sync3", 4)
            report.update(stopped_s=round(stopped, 2), late_s={r: round(v[1], 2) for r, v in late.items()})
            report["sync3_s"] = {r: round(v[1], 2) for r, v in third.items()}
        print(f"megatron {fault}: {report}")
    finally:
        ranks.close()
        rollout.close()

"""Writer, transfer buffers and the Mooncake transport against real receiver processes (Mooncake tcp).

Receivers hold 0xFF-prefilled (NaN) parameters registered with their own TransferEngine; the test process
writes with its own engine and reads back what landed.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from verl_p2p.errors import RemoteMismatchError, TransferError
from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo, TargetRank
from verl_p2p.transfer.base import TransportProxy
from verl_p2p.transfer.buffers import TransferBuffers
from verl_p2p.transfer.mooncake import MooncakeTransport
from verl_p2p.transfer.receiver import FILL_BYTE, start_receivers, stop_all
from verl_p2p.transfer.writer import WriteEntry, Writer

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytestmark = pytest.mark.slow

PARAMS = {"w.a": (1000, "float32"), "w.b": (777, "bfloat16"), "w.c": (4096, "float16")}
TIMEOUT_S = 3.0


def info_of(handle) -> RemoteRankInfo:
    return RemoteRankInfo(handle.session_id, {n: RemoteParam(*v) for n, v in handle.weights_info.items()})


@pytest.fixture(scope="module")
def receivers():
    handles = start_receivers({"e0r0": PARAMS, "e0r1": PARAMS, "e1r0": PARAMS})
    yield handles
    stop_all(handles.values())


@pytest.fixture(scope="module")
def transport():
    return MooncakeTransport("127.0.0.1", protocol="tcp", timeout_s=TIMEOUT_S)


@pytest.fixture
def targets(receivers):
    for h in receivers.values():
        h.fill()
    names = {TargetRank(0, 0): "e0r0", TargetRank(0, 1): "e0r1", TargetRank(1, 0): "e1r0"}
    return {t: info_of(receivers[n]) for t, n in names.items()}, {t: receivers[n] for t, n in names.items()}


def source_bytes(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randint(0, 255, (numel * getattr(torch, dt).itemsize,), generator=g, dtype=torch.uint8)
        for n, (numel, dt) in PARAMS.items()
    }


def test_writes_land_exactly_with_offsets(tmp_path, transport, targets):
    infos, handles = targets
    src = {t: source_bytes(i) for i, t in enumerate(infos)}
    for t in src.values():
        for v in t.values():
            transport.register(v.data_ptr(), v.numel())
    writer = Writer(transport, infos, timeout_s=TIMEOUT_S, num_workers=2)
    entries = []
    for t, params in src.items():
        if t == TargetRank(1, 0):
            continue  # untouched target stays all NaN
        a = params["w.a"]
        entries.append(WriteEntry(t, "w.a", 0, a.data_ptr(), 1000))  # w.a in two pieces
        entries.append(WriteEntry(t, "w.a", 1000, a.data_ptr() + 1000, a.numel() - 1000))
        entries.append(WriteEntry(t, "w.b", 0, params["w.b"].data_ptr(), params["w.b"].numel()))
        # w.c: only its second half
        c = params["w.c"]
        entries.append(WriteEntry(t, "w.c", c.numel() // 2, c.data_ptr() + c.numel() // 2, c.numel() // 2))
    try:
        writer.write(entries)
    finally:
        for t in src.values():
            for v in t.values():
                transport.unregister(v.data_ptr())
    for t, h in handles.items():
        got = h.dump(str(tmp_path / f"{t.engine}{t.rank}.pt"))
        if t == TargetRank(1, 0):
            assert all(bool((v == FILL_BYTE).all()) for v in got.values())
            continue
        assert torch.equal(got["w.a"], src[t]["w.a"])
        assert torch.equal(got["w.b"], src[t]["w.b"])
        half = src[t]["w.c"].numel() // 2
        assert bool((got["w.c"][:half] == FILL_BYTE).all())
        assert torch.equal(got["w.c"][half:], src[t]["w.c"][half:])
    writer.close()


def test_validate_names_target_param_and_fix(transport, targets):
    infos, handles = targets
    writer = Writer(transport, infos, timeout_s=TIMEOUT_S)
    good = {n: (numel, getattr(torch, dt).itemsize) for n, (numel, dt) in PARAMS.items()}
    writer.validate({t: good for t in infos})  # matches: no error
    t = TargetRank(0, 1)
    cases = {
        "wrong name": ({**good, "w.z": (10, 4)}, "'w.z' is not published"),
        "short": ({**good, "w.a": (999, 4)}, "numel 999 x 4 B, rollout publishes numel 1000 x 4 B"),
        "oversized": ({**good, "w.b": (778, 2)}, "numel 778 x 2 B"),
        "element size": ({**good, "w.c": (4096, 4)}, "numel 4096 x 4 B, rollout publishes numel 4096 x 2 B"),
    }
    for case, (expected, needle) in cases.items():
        with pytest.raises(RemoteMismatchError) as err:
            writer.validate({**{x: good for x in infos}, t: expected})
        msg = str(err.value)
        assert needle in msg, case
        assert f"engine 0 rank 1 (session {infos[t].session_id})" in msg, case
        assert "Likely fix" in msg and "dtype" in msg, case
    # a write entry out of the published range is refused before anything is sent
    with pytest.raises(RemoteMismatchError, match="out of range"):
        writer.submit([WriteEntry(t, "w.a", 3990, 0x1000, 100)])
    writer.close()


def test_buffers_slots_release_restore_and_reuse(tmp_path, transport, targets):
    infos, handles = targets
    t = TargetRank(1, 0)
    writer = Writer(transport, {t: infos[t]}, timeout_s=TIMEOUT_S)
    buffers = TransferBuffers(8192, transport)
    assert len(buffers.slots) == 2 and not buffers.pinned and buffers.slot_bytes_total == 2 * 8192
    buffers.release()
    assert buffers.released
    with pytest.raises(TransferError, match="restore"):
        buffers.begin()
    buffers.restore()
    buffers.begin()
    seen = set()
    for value in (1, 2, 3):  # alternate slots; each write must finish before its slot is reused
        slot, failures = buffers.next_slot()
        assert not failures
        seen.add(slot.index)
        slot.view(0, 4000).fill_(value)
        slot.track(writer.submit([WriteEntry(t, "w.a", 0, slot.addr, 4000)]))
    assert buffers.drain() == []
    assert seen == {2, 3}  # the two slots allocated by restore()
    got = handles[t].dump(str(tmp_path / "r.pt"))
    assert bool((got["w.a"] == 3).all())
    buffers.release()
    writer.close()


@pytest.fixture(scope="module")
def victims(receivers):
    """Receivers the failure tests kill or freeze, next to a healthy one; started together."""
    handles = start_receivers({"dead": PARAMS, "frozen": PARAMS, "stuck": PARAMS})
    handles["ok"] = receivers["e0r0"]
    yield handles
    stop_all([handles["dead"], handles["frozen"], handles["stuck"]])


def test_failed_write_quarantines_slot_and_spares_other_targets(tmp_path, transport, victims):
    """A killed receiver: its write fails at once, the error names it, the slot is swapped for a fresh one,
    the other target's bytes land, and the quarantined slot is freed at the next push start."""
    handles = victims
    ok, dead = TargetRank(0, 0), TargetRank(0, 1)
    infos = {ok: info_of(handles["ok"]), dead: info_of(handles["dead"])}
    writer = Writer(transport, infos, timeout_s=TIMEOUT_S)
    buffers = TransferBuffers(4096, transport)
    slot, _ = buffers.next_slot()
    slot.view(0, 4000).fill_(7)
    slot.track(writer.submit([WriteEntry(x, "w.a", 0, slot.addr, 4000) for x in (ok, dead)]))
    assert buffers.drain() == []  # warm: both sessions connected
    handles["dead"].kill()
    slot, _ = buffers.next_slot()
    slot.view(0, 4000).fill_(9)
    slot.track(writer.submit([WriteEntry(x, "w.a", 0, slot.addr, 4000) for x in (ok, dead)]))
    failures = buffers.drain()
    assert [f.target for f in failures] == [dead]
    assert f"session {infos[dead].session_id}" in failures[0].describe()
    assert "engine 0 rank 1" in failures[0].describe()
    assert slot not in buffers.slots and len(buffers.slots) == 2 and buffers.quarantined_bytes == 4096
    assert bool((handles["ok"].dump(str(tmp_path / "ok.pt"))["w.a"] == 9).all())
    # later writes to the failed target are dropped at once; the healthy one still gets them
    batch = writer.submit([WriteEntry(x, "w.a", 0, buffers.slots[0].addr, 4) for x in (ok, dead)])
    assert [f.target for f in batch.wait()] == [dead]
    buffers.begin()
    assert buffers.quarantined_bytes == 0
    buffers.release()
    writer.close()


def test_frozen_target_times_out_on_our_deadline(tmp_path, transport, victims):
    handles = victims
    ok, frozen = TargetRank(0, 0), TargetRank(1, 0)
    infos = {ok: info_of(handles["ok"]), frozen: info_of(handles["frozen"])}
    writer = Writer(transport, infos, timeout_s=TIMEOUT_S)
    src = torch.full((4000,), 5, dtype=torch.uint8)
    transport.register(src.data_ptr(), src.numel())
    writer.write([WriteEntry(x, "w.a", 0, src.data_ptr(), 4000) for x in (ok, frozen)])  # connect
    handles["frozen"].freeze()
    src.fill_(6)
    start = time.monotonic()
    with pytest.raises(TransferError) as err:
        writer.write([WriteEntry(x, "w.a", 0, src.data_ptr(), 4000) for x in (ok, frozen)])
    elapsed = time.monotonic() - start
    # Our deadline failed it, not an early transport error (the lower bound) nor Mooncake's own timeout (that
    # would not say "timed out after 3 s"); the peer is frozen until the fixture's end, so returning at all shows
    # the writer did not wait for it. No upper bound: a loaded host only makes the call later.
    assert elapsed >= TIMEOUT_S, elapsed
    msg = str(err.value)
    assert f"engine 1 rank 0 (session {infos[frozen].session_id})" in msg and "timed out after 3 s" in msg
    assert "engine 0 rank 0" not in msg
    assert bool((handles["ok"].dump(str(tmp_path / "ok.pt"))["w.a"] == 6).all())
    lingering = [th for th in threading.enumerate() if th.name == "p2p-write-e1r0"]
    assert lingering and lingering[0].is_alive()  # still blocked inside Mooncake
    handles["frozen"].kill()  # its blocked call now fails and the lane can exit
    writer.close()
    transport.unregister(src.data_ptr())


class WatchedCalls(TransportProxy):
    """The real Mooncake transport; records when a write call to `session_id` starts and when it returns."""

    def __init__(self, inner: MooncakeTransport, session_id: str) -> None:
        self.inner, self.watched = inner, session_id
        self.started, self.returned = threading.Event(), threading.Event()

    def write(self, session_id, local_addrs, remote_addrs, lengths) -> None:
        if session_id != self.watched:
            return self.inner.write(session_id, local_addrs, remote_addrs, lengths)
        self.started.set()
        try:
            return self.inner.write(session_id, local_addrs, remote_addrs, lengths)
        finally:
            self.returned.set()


def test_queued_write_keeps_its_deadline_while_workers_block_on_a_frozen_target(tmp_path, transport, victims):
    """Review defect 6: one worker, held by a call into a frozen target (another batch); a healthy target's
    write queued behind it starts once that call passes our deadline, not once Mooncake gives up on it."""
    handles = victims
    ok, stuck = TargetRank(0, 0), TargetRank(1, 1)
    infos = {ok: info_of(handles["ok"]), stuck: info_of(handles["stuck"])}
    src = torch.full((4000,), 7, dtype=torch.uint8)
    transport.register(src.data_ptr(), src.numel())
    Writer(transport, infos, timeout_s=TIMEOUT_S).write([WriteEntry(stuck, "w.a", 0, src.data_ptr(), 4000)])
    watched = WatchedCalls(transport, infos[stuck].session_id)
    writer = Writer(watched, infos, timeout_s=1.0, num_workers=1)
    handles["stuck"].freeze()
    src.fill_(8)
    frozen = writer.submit([WriteEntry(stuck, "w.a", 0, src.data_ptr(), 4000)])
    watched.started.wait()  # the only worker is now blocked inside Mooncake
    healthy = writer.submit([WriteEntry(ok, "w.a", 0, src.data_ptr(), 4000)])
    assert healthy.wait() == []  # before the fix: returned only once the frozen call came back
    assert not watched.returned.is_set(), "the healthy write waited for the frozen target's call to return"
    assert bool((handles["ok"].dump(str(tmp_path / "ok.pt"))["w.a"] == 8).all())
    failures = frozen.wait()
    assert [f.target for f in failures] == [stuck] and "timed out after 1 s" in failures[0].reason
    handles["stuck"].kill()  # its blocked call now fails and the lane can exit
    writer.close()
    transport.unregister(src.data_ptr())

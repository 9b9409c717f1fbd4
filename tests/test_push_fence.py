"""Every write the pusher submits waits for the asynchronous loads that filled its bytes (`_Pusher._fence`).

On CUDA the replica's copies into a transfer slot are asynchronous; the pusher synchronizes the feeds' devices
before the transport reads the slot. Found on the H200 (Qwen3-4B-shaped GRPO run, GPU feeds into pinned host
slots, tcp): a parameter that opened a new slot was registered for the fence before `_space` flushed (and
cleared) it, so its bytes went out before its copy finished: the start of `embed_tokens` arrived as the
zeros of fresh pinned memory, which check_weight_update_equal caught. This runs the real `_Pusher` and
`TransferBuffers`; the feeds only claim a CUDA device and `torch.cuda.synchronize` is recorded, since this host
has no GPU (the loads are the events the fence must order)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch

from verl_p2p.planning.targets import TargetRank
from verl_p2p.trainer import push as push_mod
from verl_p2p.transfer.buffers import TransferBuffers

SLOT = 4096
TARGET = TargetRank(0, 0)


class NullTransport:
    session_id = "127.0.0.1:1"

    def register(self, addr: int, nbytes: int) -> None:
        pass

    def unregister(self, addr: int) -> None:
        pass


@dataclass
class Batch:
    bytes_per_target: dict
    settled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.settled.set()

    def wait(self) -> list:
        return []


class RecordingWriter:
    def __init__(self, events: list) -> None:
        self.events = events

    def submit(self, entries) -> Batch:
        self.events.append(("submit", tuple(sorted({(e.param, e.offset) for e in entries}))))
        return Batch({TARGET: sum(e.nbytes for e in entries)})


@dataclass
class Param:
    nbytes: int
    feeds: tuple[str, ...]


class GpuFeed:
    """What the pusher reads of an HF tensor on a GPU: its device."""

    device = torch.device("cuda", 0)


class RecordingReplica:
    def __init__(self, params: dict[str, Param], events: list) -> None:
        self.params, self.events = params, events

    def chunks(self, name: str, max_bytes: int) -> list[tuple[int, int]]:
        n = self.params[name].nbytes
        return [(o, min(max_bytes, n - o)) for o in range(0, n, max_bytes)]

    def load(self, name, feeds, dst) -> None:
        self.events.append(("load", ((name, 0),)))

    def load_chunk(self, name, feeds, offset, dst) -> None:
        self.events.append(("load", ((name, offset),)))


@dataclass
class Group:
    replica: RecordingReplica
    params: dict[str, Param]
    targets: list = field(default_factory=lambda: [type("T", (), {"target": TARGET})()])

    def take(self, name: str) -> dict:
        return {f: GpuFeed() for f in self.params[name].feeds}


def unfenced_submits(events: list) -> list:
    """Loads sent by a submit with no device synchronize between the load and that submit."""
    loaded_since_sync: set = set()
    bad = []
    for kind, what in events:
        if kind == "load":
            loaded_since_sync.update(what)
        elif kind == "sync":
            loaded_since_sync.clear()
        elif kind == "submit":
            bad.extend(p for p in what if p in loaded_since_sync)
    return bad


@pytest.mark.parametrize(
    "sizes",
    [
        [1000, 3000, 6000],  # the third opens a new slot and is larger than a slot: chunked
        [300, 3900, 100],  # the first waits unsent, the second opens a new slot and alone crosses the flush size
        [600] * 12,  # many small ones, several slots
    ],
    ids=["chunked-after-full-slot", "new-slot-over-flush-size", "small"],
)
def test_every_submit_waits_for_the_loads_it_sends(monkeypatch, sizes):
    events: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device)))
    params = {f"p{i}": Param(n, (f"hf{i}",)) for i, n in enumerate(sizes)}
    group = Group(RecordingReplica(params, events), params)
    buffers = TransferBuffers(SLOT, NullTransport(), pin_memory=False)
    pusher = push_mod._Pusher(
        buffers, RecordingWriter(events), push_mod.PushMetrics(bytes_per_target={}), flush_bytes=SLOT // 8,
        load_threads=None,
    )  # fmt: skip
    for name in params:
        pusher.add(group, name)
    pusher.finish()
    sent = {p for kind, what in events if kind == "submit" for p in what}
    loaded = {p for kind, what in events if kind == "load" for p in what}
    assert sent == loaded and len(loaded) >= len(sizes)  # every load was sent
    assert unfenced_submits(events) == []

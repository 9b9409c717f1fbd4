"""Two transfer-buffer slots per trainer source, registered with the transport once.

The replica loads the next parameters into one slot while the writer sends the other. A slot is reused
only after every write reading it returned. A slot whose write failed or timed out is quarantined: the
transport may still be reading it (Mooncake can land a failed write later), so it is swapped for a fresh
slot and freed at the start of a later push (or on release), once its last write call has returned.
`release()` / `restore()` give the memory back around a verl checkpoint save and take it again afterwards.
Warm-up reads (opening a target's connection before the pause) go to a small scratch buffer of their own, never
a slot: a failed read may still land, so the scratch it used is set aside for good and a fresh one is used next.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from verl_p2p.errors import TransferError
from verl_p2p.transfer.base import Transport
from verl_p2p.transfer.writer import TargetFailure, WriteBatch

logger = logging.getLogger(__name__)

ALIGN = 256  # byte alignment of what is packed into a slot (any dtype view, fast copies)
SCRATCH_BYTES = 64  # what one warm-up read fetches (enough to open the connection)


@dataclass(eq=False)
class Slot:
    """One registered buffer; `batches` are the writes submitted from it (each reads its own byte range, so
    the rest of the slot can still be filled while they run)."""

    index: int
    tensor: torch.Tensor
    batches: list[WriteBatch] = field(default_factory=list, repr=False)

    def track(self, batch: WriteBatch) -> None:
        self.batches.append(batch)

    @property
    def settled(self) -> bool:
        """Every transport call reading this slot has returned."""
        return all(b.settled.is_set() for b in self.batches)

    def wait_settled(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(b.settled.wait(timeout=max(0.0, deadline - time.monotonic())) for b in self.batches)

    @property
    def addr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """uint8 view of `nbytes` bytes at `offset` (what the replica loads into)."""
        return self.tensor[offset : offset + nbytes]


class TransferBuffers:
    """`num_slots` (two) buffers of `slot_bytes`: host memory (pinned when CUDA is available, unless
    `pin_memory` says otherwise), or GPU memory with `device="cuda"` (needs a CUDA build of the transport;
    `verl_p2p.transfer.staging.choose_staging` picks)."""

    def __init__(
        self,
        slot_bytes: int,
        transport: Transport,
        device: str | torch.device | None = None,
        num_slots: int = 2,
        pin_memory: bool | None = None,
    ):
        if slot_bytes < ALIGN or num_slots < 1:
            raise ValueError(f"slot_bytes={slot_bytes} must be >= {ALIGN} and num_slots={num_slots} >= 1")
        self.slot_bytes = int(slot_bytes)
        self.transport = transport
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.num_slots = num_slots
        cuda_host = torch.cuda.is_available()
        self.pinned = self.device.type == "cpu" and cuda_host and (pin_memory is None or pin_memory)
        self.slots: list[Slot] = []
        self._quarantined: list[Slot] = []
        self._next = 0
        self._created = 0
        self._scratch: torch.Tensor | None = None  # warm-up reads land here (host memory, registered once)
        self._retired_scratch: list[torch.Tensor] = []  # a failed read may still land there: never reused
        self.restore()

    # ------------------------------------------------------------------ memory
    def _new_slot(self) -> Slot:
        tensor = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)
        self.transport.register(tensor.data_ptr(), tensor.numel())
        self._created += 1
        return Slot(index=self._created - 1, tensor=tensor)

    def _free(self, slot: Slot) -> None:
        self.transport.unregister(slot.addr)
        slot.tensor = torch.empty(0, dtype=torch.uint8)

    @property
    def released(self) -> bool:
        return not self.slots

    @property
    def slot_bytes_total(self) -> int:
        """Bytes of the usable slots (what the staging-memory goal is measured against)."""
        return sum(s.nbytes for s in self.slots)

    @property
    def quarantined_bytes(self) -> int:
        return sum(s.nbytes for s in self._quarantined)

    def restore(self) -> None:
        """Allocate and register the slots (no-op when they exist)."""
        while len(self.slots) < self.num_slots:
            self.slots.append(self._new_slot())

    def release(self, settle_timeout_s: float = 60.0) -> None:
        """Unregister and free every slot (around a checkpoint save). Writes must have been waited for;
        a quarantined slot still read by a lingering call is waited for up to `settle_timeout_s`."""
        busy = [s.index for s in self.slots if not s.settled]
        if busy:
            raise TransferError(f"release() with writes in flight from slot(s) {busy}: wait for the push to finish")
        deadline = time.monotonic() + settle_timeout_s
        for slot in self._quarantined:
            slot.wait_settled(max(0.0, deadline - time.monotonic()))
        for slot in self.slots:
            self._free(slot)
        self.slots.clear()
        self._next = 0
        self.reclaim()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the slots' GPU memory back, not just to torch's cache
        if self._quarantined:
            logger.warning(
                "%d quarantined transfer slot(s) still read by a blocked write; freed once it returns",
                len(self._quarantined),
            )

    def reclaim(self) -> None:
        """Free quarantined slots whose last write call has returned."""
        keep = []
        for slot in self._quarantined:
            if slot.settled:
                self._free(slot)
            else:
                keep.append(slot)
        self._quarantined = keep

    def _quarantine(self, slot: Slot) -> Slot:
        """Set `slot` aside until its writes return and put a fresh registered slot in its place."""
        fresh = self._new_slot()
        self.slots[self.slots.index(slot)] = fresh
        self._quarantined.append(slot)
        return fresh

    # ------------------------------------------------------------------ warm-up reads
    def scratch(self) -> int:
        """Address of `SCRATCH_BYTES` of registered host memory for warm-up reads; never part of a slot, and kept
        across release()/restore() (a read that failed may still land in it)."""
        if self._scratch is None:
            self._scratch = torch.zeros(SCRATCH_BYTES, dtype=torch.uint8)
            self.transport.register(self._scratch.data_ptr(), self._scratch.numel())
        return self._scratch.data_ptr()

    def retire_scratch(self) -> None:
        """A read into the scratch failed: it may still land there, so the next read gets a fresh one."""
        if self._scratch is not None:
            self._retired_scratch.append(self._scratch)
            self._scratch = None

    # ------------------------------------------------------------------ use
    def begin(self) -> None:
        """Start of a push: the slots must exist; quarantined slots from earlier pushes are freed once settled."""
        if self.released:
            raise TransferError("transfer buffers are released (checkpoint save): call restore() before pushing")
        self.reclaim()

    def next_slot(self) -> tuple[Slot, list[TargetFailure]]:
        """The next slot in turn, once the writes reading it returned (or failed: then a fresh slot);
        also the failures those writes reported."""
        if self.released:
            raise TransferError("transfer buffers are released (checkpoint save): call restore() before pushing")
        slot = self.slots[self._next % len(self.slots)]
        self._next += 1
        failures = self._settle(slot)
        if failures or not slot.settled:
            slot = self._quarantine(slot)
        slot.batches = []
        return slot, failures

    def drain(self) -> list[TargetFailure]:
        """Wait for the writes of every slot (end of a push); failed ones are quarantined."""
        failures: list[TargetFailure] = []
        for slot in list(self.slots):
            slot_failures = self._settle(slot)
            failures.extend(slot_failures)
            if slot_failures or not slot.settled:
                self._quarantine(slot)
            else:
                slot.batches = []
        return failures

    @staticmethod
    def _settle(slot: Slot) -> list[TargetFailure]:
        """Wait (deadline-bounded) for every batch reading the slot; their failures, one per target."""
        failures: dict = {}
        for batch in slot.batches:
            for f in batch.wait():
                failures.setdefault(f.target, f)
        return list(failures.values())

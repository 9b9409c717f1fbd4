"""Raw Mooncake writes of a push's own write lists: the yardstick a push is measured against.

A push's writer submits lists of `WriteEntry` (slot address, target parameter, offset, length). Replaying
those lists through the same writer moves the same bytes over the same lanes into the same remote ranges,
with the push's slot flow control, but without the export, the replica or the staging: what Mooncake alone
takes for those bytes. `verl-p2p bench` and `verl-p2p e2e` put each push beside its replay, in the same run.
The replay writes whatever the slots hold now: run it only where a push rewrites the targets afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from verl_p2p.transfer.writer import WriteEntry, Writer


def raw_replay(writer: Writer, recorded: Sequence[Sequence[WriteEntry]], slots: Sequence[tuple[int, int]]) -> float:
    """Submit `recorded` again (same slots, same remote ranges, same lanes): a slot's writes start once the
    writes of that slot's previous fill returned. Returns the wall seconds; raises naming the failed writes."""

    def slot_of(entries: Sequence[WriteEntry]) -> int:
        addr = entries[0].local_addr
        return next(i for i, (lo, hi) in enumerate(slots) if lo <= addr < hi)

    start = time.perf_counter()
    in_flight: dict[int, list] = {}  # slot -> batches of its current fill
    previous = None
    failures = []
    for entries in recorded:
        if not entries:
            continue
        slot = slot_of(entries)
        if slot != previous:  # a new fill of this slot: its previous fill must have landed
            failures += [f for b in in_flight.pop(slot, []) for f in b.wait()]
            previous = slot
        in_flight.setdefault(slot, []).append(writer.submit(list(entries)))
    failures += [f for batches in in_flight.values() for b in batches for f in b.wait()]
    elapsed = time.perf_counter() - start
    if failures:
        raise RuntimeError(f"raw replay failed: {[f.describe() for f in failures]}")
    return elapsed

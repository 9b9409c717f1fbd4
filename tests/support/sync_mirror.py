"""MirrorPush: a real weight push into loopback engines that needs no trainer-side replica.

Every rank gets its own start-up weights (SGLang's load, read once with `dump`) scaled by a factor, written
with one-sided Mooncake tcp writes through verl_p2p's real `Writer` (one lane per target, the
p2p_transfer_timeout deadline, failures naming engine / rank / session), in batches of at most `bucket_bytes`
per target. Like `verl_p2p.trainer.push.push`, a failed target's later writes are dropped, the other targets still get
all their bytes, and the push raises `push_error` naming every failed target at the end.

Why not SourceSession: the trainer-side replica reproduces only its own SGLang release's bytes and refuses a
server reporting another one (`RankContext`), while the tests need engines claiming SGLang 0.5.23 (weight-update
sessions) next to an installed 0.5.12. The lifecycle, the adapters, the writer and Mooncake are the real ones;
the replica's bytes are proven elsewhere (the demo, tests/test_replica_*.py).

`after_batch(i)` runs after batch i was written: the deterministic place to kill or freeze a rank mid-push.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from verl_p2p.planning.targets import TargetRank
from verl_p2p.transfer.mooncake import MooncakeTransport
from verl_p2p.transfer.writer import TargetFailure, WriteEntry, Writer, push_error


class MirrorPush:
    def __init__(
        self,
        engines: Sequence[Any],
        *,
        timeout_s: float,
        bucket_bytes: int = 64 << 10,
        hostname: str = "127.0.0.1",
        num_workers: int = 8,
    ) -> None:
        self.engines = list(engines)
        self.timeout_s, self.bucket_bytes, self.num_workers = timeout_s, bucket_bytes, num_workers
        self.witness: dict[TargetRank, dict[str, torch.Tensor]] = {
            TargetRank(e, r): engine.dump(r) for e, engine in enumerate(self.engines) for r in range(engine.spec.tp)
        }
        self.transport = MooncakeTransport(hostname, "tcp", timeout_s=timeout_s)
        # One flat registered staging buffer per target, params packed in name order.
        self._layout: dict[TargetRank, list[tuple[str, int, int]]] = {}
        self._staging: dict[TargetRank, torch.Tensor] = {}
        for target, params in self.witness.items():
            layout, offset = [], 0
            for name in sorted(params):
                nbytes = params[name].numel() * params[name].element_size()
                layout.append((name, offset, nbytes))
                offset += nbytes
            self._layout[target] = layout
            self._staging[target] = buf = torch.empty(offset, dtype=torch.uint8)
            self.transport.register(buf.data_ptr(), buf.numel())
        self.after_batch: Callable[[int], None] | None = None
        self.after_write: Callable[[], None] | None = None
        self.held_scale = 1.0  # what every rank holds after the last push that fully succeeded
        self.started: float | None = None  # wall clock (time.time, as the loopback event log) of the last push
        self.finished: float | None = None
        self.num_batches = 0

    @property
    def targets(self) -> list[TargetRank]:
        return sorted(self.witness)

    def expected(self, target: TargetRank, scale: float) -> dict[str, torch.Tensor]:
        return {name: t * scale for name, t in self.witness[target].items()}

    def mismatches(self, scale: float, engines: Sequence[int] | None = None) -> list[str]:
        """Every (engine, rank, param) whose held bytes differ from its start-up bytes scaled by `scale`."""
        problems = []
        for target in self.targets:
            if engines is not None and target.engine not in engines:
                continue
            held = self.engines[target.engine].dump(target.rank)
            for name, want in self.expected(target, scale).items():
                got = held[name]
                if got.shape != want.shape or not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                    problems.append(f"{target}: {name}")
        return problems

    def _stage(self, scale: float) -> None:
        for target, layout in self._layout.items():
            buf = self._staging[target]
            for name, offset, nbytes in layout:
                src = (self.witness[target][name] * scale).contiguous().view(-1).view(torch.uint8)
                buf[offset : offset + nbytes].copy_(src)

    def _batches(self) -> list[list[WriteEntry]]:
        """Entry lists, each carrying at most `bucket_bytes` per target (large params are chunked)."""
        per_target: dict[TargetRank, list[list[WriteEntry]]] = {}
        for target, layout in self._layout.items():
            base = self._staging[target].data_ptr()
            groups: list[list[WriteEntry]] = [[]]
            fill = 0
            for name, offset, nbytes in layout:
                done = 0
                while done < nbytes:
                    if fill >= self.bucket_bytes:
                        groups.append([])
                        fill = 0
                    n = min(nbytes - done, self.bucket_bytes - fill)
                    groups[-1].append(WriteEntry(target, name, done, base + offset + done, n))
                    done += n
                    fill += n
            per_target[target] = groups
        count = max(len(g) for g in per_target.values())
        return [[e for groups in per_target.values() if i < len(groups) for e in groups[i]] for i in range(count)]

    def push_blocking(self, connection: Any, scale: float) -> dict:
        missing = set(self.targets) - set(connection.rank_infos)
        assert not missing, f"connection lacks targets {sorted(missing)}"
        self._stage(scale)
        writer = Writer(
            self.transport,
            {t: connection.rank_infos[t] for t in self.targets},
            timeout_s=self.timeout_s,
            num_workers=self.num_workers,
        )
        failures: dict[TargetRank, TargetFailure] = {}
        batches = self._batches()
        self.num_batches = len(batches)
        self.started, self.finished = time.time(), None
        try:
            for i, entries in enumerate(batches):
                for failure in writer.submit(entries).wait():
                    failures.setdefault(failure.target, failure)
                if self.after_batch is not None:
                    self.after_batch(i)
        finally:
            self.finished = time.time()
            writer.close()
        if self.after_write is not None:
            self.after_write()
        if failures:
            raise push_error(failures[t] for t in sorted(failures))
        self.held_scale = scale
        return {"bytes": sum(b.numel() for b in self._staging.values()), "batches": len(batches)}

    def push(self, scale: float):
        """The lifecycle's `push` callable writing `scale` x start-up weights."""

        async def run(connection: Any) -> dict:
            return await asyncio.to_thread(self.push_blocking, connection, scale)

        return run

    def close(self) -> None:
        for buf in self._staging.values():
            try:
                self.transport.unregister(buf.data_ptr())
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass

"""MirrorPush: the stand-in trainer of the loopback rollout, a real weight push that needs no trainer-side replica.

Every rank gets its own start-up weights (SGLang's load, read once with `dump`) scaled by a factor, written with
one-sided Mooncake tcp writes through verl_p2p's real `Writer` (one lane per target, the p2p_transfer_timeout
deadline, failures naming engine / rank / session), in batches of at most `bucket_bytes` per target. Like
`verl_p2p.trainer.push.push`, a failed target's later writes are dropped, the other targets still get all their
bytes, and the push raises `push_error` naming every failed target (its `unknown_targets`) at the end. It writes
the targets of the Connection it is given: all of them, or only those a retry re-pushes.

Why not SourceSession: the trainer-side replica reproduces only its own SGLang release's bytes and refuses a
server reporting another one, while tests and the soak need engines claiming SGLang 0.5.23 (weight-update
sessions) next to an installed 0.5.12. The lifecycle, the adapters, the writer and Mooncake are the real ones;
the replica's bytes are proven elsewhere (the demo, tests/test_replica_*.py).

Test and soak hooks (a facility of the stand-in, like loopback/fault_injection.py): `after_batch(i)` runs after
batch i was written (the deterministic place to kill or freeze a rank mid-push), `after_write()` once the writes
returned, and `fail_writes(target, pushes)` makes that target's writes fail after its first batch in the next
`pushes` pushes that reach it (a partial push).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from verl_p2p.errors import TransferError
from verl_p2p.planning.targets import TargetRank
from verl_p2p.transfer.base import TransportProxy
from verl_p2p.transfer.mooncake import MooncakeTransport
from verl_p2p.transfer.writer import TargetFailure, WriteEntry, Writer, push_error


class _InjectedWriteFailures(TransportProxy):
    """The transport, except that writes to `failing` sessions fail once they made `after` calls (this push)."""

    def __init__(self, inner: MooncakeTransport, failing: Mapping[str, int]) -> None:
        self.inner, self.left = inner, dict(failing)
        self._lock = threading.Lock()

    def write(self, session_id, local_addrs, remote_addrs, lengths) -> None:
        with self._lock:
            left = self.left.get(session_id)
            if left is not None:
                self.left[session_id] = left - 1
        if left is not None and left <= 0:
            raise TransferError(f"injected write failure to session {session_id} (loopback fault injection)")
        self.inner.write(session_id, local_addrs, remote_addrs, lengths)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)  # 0-dim too (an FP8 attention's k_scale / v_scale)


def scaled(held: torch.Tensor, scale: float) -> torch.Tensor:
    """What a rank holds after loading `scale` x the weights it holds: x `scale`, except block-FP8 weight bytes.
    Quantizing scale x w for a power-of-two scale gives w's e4m3 bytes again and scale x its block scales (the
    fp32 `weight_scale_inv` beside them, which this scales), so those bytes stay as they are."""
    if held.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        mantissa, _ = torch.frexp(torch.tensor(float(scale)))
        if float(mantissa) != 0.5:
            raise ValueError(f"scale {scale} of an FP8 rank: only powers of two keep its e4m3 bytes exact")
        return held
    return held * scale


class MirrorPush:
    """Writes `scale` x each target's start-up weights (`witness`) into the targets of a Connection.

    `dump(target)` reads a target's current parameters (for `mismatches`); `of_engines` builds both from
    in-process LoopbackEngines."""

    def __init__(
        self,
        witness: Mapping[TargetRank, Mapping[str, torch.Tensor]],
        dump: Callable[[TargetRank], Mapping[str, torch.Tensor]],
        *,
        timeout_s: float,
        bucket_bytes: int = 64 << 10,
        hostname: str = "127.0.0.1",
        num_workers: int = 8,
    ) -> None:
        self.witness = {t: dict(params) for t, params in witness.items()}
        self.dump = dump
        self.timeout_s, self.bucket_bytes, self.num_workers = timeout_s, bucket_bytes, num_workers
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
        self._failing: dict[TargetRank, int] = {}  # target -> pushes still failing it
        # the scale each target last got whole; None: its last push failed, its bytes are unknown
        self.held: dict[TargetRank, float | None] = {t: 1.0 for t in self.witness}
        self.started: float | None = None  # wall clock (time.time, as the loopback event log) of the last push
        self.finished: float | None = None
        self.num_batches = 0
        self.pushed_targets: list[TargetRank] = []  # what the last push was asked to write

    @classmethod
    def of_engines(cls, engines: Sequence[Any], **kwargs: Any) -> MirrorPush:
        """Over in-process LoopbackEngines, engine index = position."""
        witness = {TargetRank(e, r): engine.dump(r) for e, engine in enumerate(engines) for r in range(engine.spec.tp)}
        return cls(witness, lambda t: engines[t.engine].dump(t.rank), **kwargs)

    @property
    def targets(self) -> list[TargetRank]:
        return sorted(self.witness)

    @property
    def held_scale(self) -> float:
        """The scale every target holds, when they all hold the same (the last push that fully succeeded)."""
        scales = set(self.held.values())
        if len(scales) != 1:
            raise AssertionError(f"targets hold different scales: {self.held}")
        return scales.pop()

    def expected(self, target: TargetRank, scale: float) -> dict[str, torch.Tensor]:
        return {name: scaled(t, scale) for name, t in self.witness[target].items()}

    def mismatches(self, scale: float, engines: Sequence[int] | None = None) -> list[str]:
        """Every target (and param) whose held bytes differ from its start-up bytes scaled by `scale`."""
        problems = []
        for target in self.targets:
            if engines is not None and target.engine not in engines:
                continue
            problems += [f"{target}: {name}" for name in self.differing(target, scale)]
        return problems

    def differing(self, target: TargetRank, scale: float) -> list[str]:
        """The params of `target` whose bytes are not exactly `scale` x its start-up bytes."""
        held = self.dump(target)
        out = []
        for name, want in self.expected(target, scale).items():
            got = held.get(name)
            if got is None or got.shape != want.shape or not torch.equal(_bytes(got), _bytes(want)):
                out.append(name)
        return out

    def fail_writes(self, target: TargetRank, pushes: int = 1) -> None:
        """In the next `pushes` pushes that write `target`, its writes fail after its first batch."""
        self._failing[target] = pushes

    def _stage(self, scale: float, targets: Sequence[TargetRank]) -> None:
        for target in targets:
            buf = self._staging[target]
            for name, offset, nbytes in self._layout[target]:
                src = scaled(self.witness[target][name], scale).contiguous().view(-1).view(torch.uint8)
                buf[offset : offset + nbytes].copy_(src)

    def _batches(self, targets: Sequence[TargetRank]) -> list[list[WriteEntry]]:
        """Entry lists, each carrying at most `bucket_bytes` per target (large params are chunked)."""
        per_target: dict[TargetRank, list[list[WriteEntry]]] = {}
        for target in targets:
            base = self._staging[target].data_ptr()
            groups: list[list[WriteEntry]] = [[]]
            fill = 0
            for name, offset, nbytes in self._layout[target]:
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
        count = max((len(g) for g in per_target.values()), default=0)
        return [[e for groups in per_target.values() if i < len(groups) for e in groups[i]] for i in range(count)]

    def push_blocking(self, connection: Any, scale: float) -> dict:
        targets = list(connection.targets)
        unknown = sorted(set(targets) - set(self.witness))
        if unknown:
            raise ValueError(f"the mirror push has no start-up weights of {unknown}")
        self._stage(scale, targets)
        failing = {}
        for target in targets:
            if self._failing.get(target, 0) > 0:
                self._failing[target] -= 1
                failing[connection.rank_infos[target].session_id] = 1  # its first batch lands, then writes fail
        transport = _InjectedWriteFailures(self.transport, failing) if failing else self.transport
        writer = Writer(
            transport,
            {t: connection.rank_infos[t] for t in targets},
            timeout_s=self.timeout_s,
            num_workers=self.num_workers,
        )
        failures: dict[TargetRank, TargetFailure] = {}
        batches = self._batches(targets)
        self.num_batches, self.pushed_targets = len(batches), targets
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
        for target in targets:
            self.held[target] = None if target in failures else scale
        if self.after_write is not None:
            self.after_write()
        if failures:
            raise push_error(failures[t] for t in sorted(failures))
        return {"bytes": sum(self._staging[t].numel() for t in targets), "batches": len(batches)}

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

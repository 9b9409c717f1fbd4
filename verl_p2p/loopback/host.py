"""LoopbackHost: loopback engines served by a child process and driven over a pipe (a soak facility).

The soak measures the resources (RSS, open files, threads) of the process running the sync: the lifecycle, the
HTTP clients, the writer and Mooncake. The loopback engines (their HTTP servers, event logs and rank processes)
therefore live in a child process of their own, and the driver reaches them through `LoopbackHost`: read a
rank's weights and an engine's state or violations, arm faults (kill or freeze a rank, canned HTTP answers,
held calls), and restart an engine whose rank was killed, as a rollout would be restarted.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from verl_p2p import pipe


@dataclass(frozen=True)
class EngineAddress:
    """Where one engine of the host serves."""

    url: str
    bootstrap_url: str
    tp: int


class HostError(RuntimeError):
    """A host command failed; the message carries the host-side traceback."""


def _serve(conn, specs: Sequence[Any], model_path: str) -> None:
    """The child process: start every engine, then answer commands until "stop" or the pipe closes."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from verl_p2p.loopback.engine import LoopbackEngine

    engines: dict[int, LoopbackEngine] = {}
    restarting: dict[int, threading.Thread] = {}
    failed: dict[int, str] = {}

    def start(index: int) -> None:
        try:
            engines[index] = LoopbackEngine(specs[index], model_path).start().wait_ready()
        except BaseException:  # reported by "address"
            failed[index] = traceback.format_exc()

    def address(index: int) -> EngineAddress | None:
        if index in failed:
            raise HostError(f"engine {index} failed to start:\n{failed.pop(index)}")
        thread = restarting.get(index)
        if thread is not None and thread.is_alive():
            return None
        restarting.pop(index, None)
        engine = engines[index]
        return EngineAddress(engine.url, engine.bootstrap_url, engine.spec.tp)

    def restart(index: int) -> None:
        old = engines.pop(index)
        old.stop()
        thread = restarting[index] = threading.Thread(target=start, args=(index,), daemon=True)
        thread.start()

    def dump(index: int, rank: int) -> bytes:
        engine = engines[index]
        return engine._rank(rank).call("dump", engine.spec.rank_timeout_s)

    commands = {
        "address": address,
        "dump": dump,
        "state": lambda i: engines[i].state(),
        "violations": lambda i, since=0: engines[i].violations(since),
        "events_count": lambda i: len(engines[i].lifecycle.events()),
        "kill_rank": lambda i, r: engines[i].kill_rank(r),
        "freeze_rank": lambda i, r: engines[i].freeze_rank(r),
        "thaw_rank": lambda i, r: engines[i].thaw_rank(r),
        "fail": lambda i, *a, **k: engines[i].faults.fail(*a, **k),
        "slow": lambda i, *a, **k: engines[i].faults.slow(*a, **k),
        "clear_faults": lambda i: engines[i].faults.clear(),
        "restart": restart,
    }
    try:
        starters = [threading.Thread(target=start, args=(i,)) for i in range(len(specs))]
        for thread in starters:
            thread.start()
        for thread in starters:
            thread.join()
        pipe.send(conn, ("ready", None) if not failed else ("error", "\n".join(failed.values())))
        while True:
            try:
                name, args, kwargs = conn.recv()
            except (EOFError, OSError):
                break
            if name == "stop":
                break
            try:
                pipe.send(conn, ("ok", commands[name](*args, **kwargs)))
            except Exception:  # answered to the driver, never fatal here
                pipe.send(conn, ("error", traceback.format_exc()))
    finally:
        for engine in engines.values():
            engine.stop()
        conn.close()


class LoopbackHost:
    """The driver's handle on the child process serving the engines (thread-safe: one command at a time)."""

    def __init__(self, specs: Sequence[Any], model_path: str, start_timeout_s: float = 900.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, list(specs), str(model_path)), name="loopback-host")
        self._process.start()
        child.close()
        self._lock = threading.Lock()
        self.num_engines = len(specs)
        if not self._conn.poll(start_timeout_s):
            self.stop()
            raise HostError(f"loopback host did not start its engines in {start_timeout_s:g} s")
        kind, payload = self._conn.recv()
        if kind != "ready":
            self.stop()
            raise HostError(f"loopback host failed to start:\n{payload}")

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            pipe.send(self._conn, (name, args, kwargs))
            kind, payload = self._conn.recv()
        if kind != "ok":
            raise HostError(f"loopback host: {name}{args}: {payload}")
        return payload

    def address(self, engine: int) -> EngineAddress | None:
        """Where `engine` serves; None while it restarts."""
        return self.call("address", engine)

    def dump(self, engine: int, rank: int) -> dict[str, Any]:
        import torch

        return torch.load(io.BytesIO(self.call("dump", engine, rank)), weights_only=True)

    @property
    def pid(self) -> int:
        return self._process.pid

    def stop(self, timeout: float = 60.0) -> None:
        if self._process.is_alive():
            try:
                with self._lock:
                    pipe.send(self._conn, ("stop", (), {}))
            except OSError:
                pass
            self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)
        self._conn.close()

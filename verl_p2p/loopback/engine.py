"""Loopback engines: start, observe, perturb and stop local SGLang-compatible rollout engines.

One engine = its bootstrap server and control-plane server (threads of this process) plus one spawned
process per TP rank. `loopback_engines` starts several in parallel on free ports and always stops them;
rank processes also exit on their own when this process dies.
"""

from __future__ import annotations

import atexit
import io
import os
import random
import signal
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait as wait_sentinels
from typing import Any

from verl_p2p.loopback.bootstrap import BootstrapServer
from verl_p2p.loopback.control import ControlContext, ThreadedServer, create_app
from verl_p2p.loopback.fault_injection import LoopbackFaults
from verl_p2p.loopback.features import Features, installed_sglang_version
from verl_p2p.loopback.lifecycle import VIOLATION, Lifecycle
from verl_p2p.loopback.rank_worker import DEFAULT_BUILDER, RANK_PRELOAD, RankArgs, RankHandle, rank_main
from verl_p2p.loopback.server_args import (
    cpu_rank_settings,
    launch_server_args,
    resolve_server_args,
    server_args_field_names,
)
from verl_p2p.sandbox import forked


@dataclass(frozen=True)
class EngineSpec:
    """Layout and behaviour of one loopback engine."""

    tp: int = 2
    ep: int = 1
    dp_attention: int = 1
    dtype: str = "float32"
    api_key: str | None = None
    sglang_version: str | None = None  # the version the control plane imitates; None: the installed SGLang's
    port: int | None = None  # control plane; None: a free port
    bootstrap_port: int | None = None  # None: a free port
    host: str = "127.0.0.1"
    rank_timeout_s: float = 60.0  # a rank that does not answer a control call in time is reported unavailable
    start_timeout_s: float = 600.0
    server_args_overrides: dict[str, Any] = field(default_factory=dict)
    builder: str = DEFAULT_BUILDER  # "module:function" building a rank's model (default: SGLang's real path)


_port_lock = threading.Lock()
_ports_given: set[int] = set()
# Below Linux's ephemeral range (32768+, outgoing connections) and Mooncake's RPC ports (15000-17000 here);
# also below 55536, because ServerArgs derives grpc_port = port + 10000 and rejects anything above 65535.
PORT_RANGE = (20000, 32000)


def free_port(host: str = "127.0.0.1") -> int:
    """A port in PORT_RANGE that nobody listens on now and this process has not handed out before."""
    with _port_lock:
        for _ in range(1000):
            port = random.randrange(*PORT_RANGE)
            if port in _ports_given:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _ports_given.add(port)
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


_live_engines: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all_engines() -> None:
    for engine in list(_live_engines):
        engine.stop()


class LoopbackEngine:
    """One engine. `start()` returns at once; `wait_ready()` blocks until every rank published its info."""

    def __init__(self, spec: EngineSpec, model_path: str):
        self.spec, self.model_path = spec, str(model_path)
        self.features = Features.of(spec.sglang_version or installed_sglang_version())
        self.port = spec.port or free_port(spec.host)
        self.bootstrap_port = spec.bootstrap_port or free_port(spec.host)
        self.launch_args: dict[str, Any] = {}  # ServerArgs fields the ranks are launched with
        self.server_args: dict[str, Any] = {}  # the resolved ServerArgs, as /server_info reports them
        self.lifecycle = Lifecycle()
        self.faults = LoopbackFaults()  # test/soak fault injection into the control plane
        self._ranks: list[RankHandle] = []
        self._bootstrap: BootstrapServer | None = None
        self._http: ThreadedServer | None = None
        self._monitor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stopped = False
        self.ready = False

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    @property
    def bootstrap_url(self) -> str:
        return f"http://{self.spec.host}:{self.bootstrap_port}"

    # ------------------------------------------------------------------ start / stop
    def start(self) -> LoopbackEngine:
        """Spawn the ranks first (their SGLang imports dominate start-up), then serve the bootstrap server."""
        spec = self.spec
        if spec.tp < 1 or spec.tp % spec.ep or spec.tp % spec.dp_attention:
            raise ValueError(f"tp={spec.tp} must be divisible by ep={spec.ep} and dp_attention={spec.dp_attention}")
        _live_engines.add(self)
        self.launch_args = launch_server_args(
            self.model_path,
            tp=spec.tp,
            ep=spec.ep,
            dp_attention=spec.dp_attention,
            dtype=spec.dtype,
            host=spec.host,
            port=self.port,
            bootstrap_port=self.bootstrap_port,
            api_key=spec.api_key,
            **{**cpu_rank_settings(self.model_path, server_args_field_names()), **spec.server_args_overrides},
        )
        try:
            self._spawn_ranks()
            self._bootstrap = BootstrapServer(spec.host, self.bootstrap_port)
            self._bootstrap.wait_ready()
            self.server_args = resolve_server_args(self.launch_args)
        except BaseException:
            self.stop()
            raise
        self.lifecycle.set_weight_version(self.server_args.get("weight_version") or "default")
        return self

    def _spawn_ranks(self) -> None:
        spec = self.spec
        ctx = forked.context(RANK_PRELOAD)
        dist_init = f"tcp://{spec.host}:{free_port(spec.host)}"
        for rank in range(spec.tp):
            args = RankArgs(
                rank=rank,
                tp_size=spec.tp,
                model_path=self.model_path,
                server_args=self.launch_args,
                dist_init_method=dist_init,
                bootstrap_url=self.bootstrap_url,
                host=spec.host,
                builder=spec.builder,
            )
            parent_conn, child_conn = ctx.Pipe()
            proc = forked.process(
                rank_main,
                (args, child_conn, os.getpid()),
                RANK_PRELOAD,
                name=f"loopback-{self.port}-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._ranks.append(RankHandle(rank, proc, parent_conn))

    def wait_ready(self) -> LoopbackEngine:
        """Wait for every rank, then serve the control plane; on failure stop everything and raise."""
        try:
            deadline = time.monotonic() + self.spec.start_timeout_s
            for handle in self._ranks:
                handle.wait_ready(deadline)
            registered = self._bootstrap.registered_ranks()
            if registered != list(range(self.spec.tp)):
                raise RuntimeError(f"bootstrap registrations {registered} != ranks 0..{self.spec.tp - 1}")
            context = ControlContext(
                lifecycle=self.lifecycle,
                features=self.features,
                server_args=self.server_args,
                bootstrap_url=self.bootstrap_url,
                ranks=self._ranks,
                rank_timeout=self.spec.rank_timeout_s,
                faults=self.faults,
            )
            # it has been serving since start-up: its prefix cache holds KV computed with the loaded weights
            loaded = {str(r): d for r, d in context.weight_digests(30.0).items() if d}
            self.lifecycle.state.prefix_cache_from = loaded
            self.lifecycle.state.serving_from = dict(loaded)  # it generates from the start
            self._http = ThreadedServer(create_app(context), self.spec.host, self.port)
            self._http.start()
        except BaseException:
            self.stop()
            raise
        self._monitor = threading.Thread(target=self._watch_ranks, daemon=True, name=f"loopback-watch-{self.port}")
        self._monitor.start()
        self.ready = True
        return self

    def _watch_ranks(self) -> None:
        """Unregister a rank from the bootstrap server as soon as its process dies."""
        gone: set[int] = set()
        while not self._stopping.is_set():
            live = {h.process.sentinel: h for h in self._ranks if h.rank not in gone}
            if not live:
                return
            for sentinel in wait_sentinels(list(live), timeout=0.5):
                handle = live[sentinel]
                gone.add(handle.rank)
                self._bootstrap.unregister(handle.rank)

    def stop(self) -> None:
        """Stop the servers and every rank process; safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._http is not None:
            self._http.stop()
        for handle in self._ranks:
            handle.request_stop()
        for handle in self._ranks:
            handle.stop()
        if self._bootstrap is not None:
            self._bootstrap.close()
        if self._monitor is not None:
            self._monitor.join(2)
        _live_engines.discard(self)

    def __enter__(self) -> LoopbackEngine:
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ test hooks
    def _rank(self, rank: int) -> RankHandle:
        if not 0 <= rank < len(self._ranks):
            raise IndexError(f"rank {rank} outside tp={self.spec.tp}")
        return self._ranks[rank]

    def rank_pid(self, rank: int) -> int:
        return self._rank(rank).pid

    def dump(self, rank: int) -> dict[str, Any]:
        """Copies of rank `rank`'s current parameters, {SGLang parameter name: CPU tensor}."""
        import torch

        data = self._rank(rank).call("dump", self.spec.rank_timeout_s)
        return torch.load(io.BytesIO(data), weights_only=True)

    def dump_derived(self, rank: int) -> dict[str, Any]:
        """Copies of rank `rank`'s derived non-parameter tensors (MLA's w_kc / w_vc), {name: CPU tensor}."""
        import torch

        data = self._rank(rank).call("dump_derived", self.spec.rank_timeout_s)
        return torch.load(io.BytesIO(data), weights_only=True)

    def flip_byte(self, rank: int, param: str, index: int = 0) -> tuple[int, int]:
        """Invert every bit of byte `index` of `param` on rank `rank`; returns (old, new) byte values."""
        return tuple(self._rank(rank).call("flip_byte", self.spec.rank_timeout_s, name=param, index=index))

    def ranks_alive(self) -> list[bool]:
        return [h.alive() for h in self._ranks]

    def kill_rank(self, rank: int) -> None:
        """SIGKILL rank `rank` and wait until it is gone (its bootstrap registration is removed)."""
        handle = self._rank(rank)
        handle.kill()
        self._bootstrap.unregister(rank)

    def freeze_rank(self, rank: int) -> None:
        """SIGSTOP: the rank (and its Mooncake listener) stops answering without dying."""
        self._rank(rank).signal(signal.SIGSTOP)

    def thaw_rank(self, rank: int) -> None:
        self._rank(rank).signal(signal.SIGCONT)

    def events(self, since: int = 0) -> list[dict]:
        """The control-plane event log (same content as GET /loopback/events)."""
        return [asdict(e) for e in self.lifecycle.events(since)]

    def violations(self, since: int = 0) -> list[dict]:
        """The events recording what SGLang allows but p2p must never do (loopback/lifecycle.py)."""
        return [e for e in self.events(since) if e["method"] == VIOLATION]

    def state(self) -> dict[str, Any]:
        """The control plane's lifecycle state now (paused, session_open, weight_version, ...)."""
        with self.lifecycle.lock:
            return asdict(self.lifecycle.state)


@contextmanager
def loopback_engines(specs: list[EngineSpec], model_path: str) -> Iterator[list[LoopbackEngine]]:
    """Start one engine per spec in parallel, wait until every rank registered, stop them all on exit."""
    engines = [LoopbackEngine(spec, model_path) for spec in specs]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines:
            engine.stop()

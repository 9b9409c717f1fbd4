"""Mooncake TransferEngine transport (docs/protocol.md section 4): rdma in production, tcp in tests.

The rollout ranks already run Mooncake engines (SGLang's remote-instance weight loader) and publish
`host:rpc_port` session ids, so the trainer side only needs its own engine in P2PHANDSHAKE mode.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from verl_p2p.environment import environment_set
from verl_p2p.errors import TransferError
from verl_p2p.transfer.base import check_rc

_INSTALL_HINT = (
    "install Mooncake: `pip install mooncake-transfer-engine` on CUDA hosts "
    "(or mooncake-transfer-engine-cuda13), `pip install mooncake-transfer-engine-non-cuda` on CPU-only hosts "
    "(needs the libibverbs1 system package)"
)

# Mooncake reads MC_TRANSFER_TIMEOUT when an engine is built (measured: per engine, not per process);
# the lock keeps one engine's value from leaking into another's start.
_ENGINE_START_LOCK = threading.Lock()


def import_transfer_engine():
    """`mooncake.engine.TransferEngine`, or a TransferError naming the package to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferError(f"Mooncake is not importable ({exc}); {_INSTALL_HINT}") from exc
    return TransferEngine


# Mooncake's wheels: one name per build. CUDA builds can register GPU memory (GPUDirect RDMA on real NICs).
MOONCAKE_CUDA_DISTS = ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13")
MOONCAKE_HOST_DISTS = ("mooncake-transfer-engine-non-cuda",)
# Symbols only a CUDA build of the engine links (it asks CUDA where a registered address lives).
_CUDA_SYMBOLS = (b"cudaPointerGetAttributes", b"libcudart")


def mooncake_gpu_memory_support() -> tuple[bool, str]:
    """Whether the installed Mooncake can register (and write from) GPU memory, and how that was decided:
    by the installed wheel's name, else (a source build) by whether its engine links the CUDA runtime."""
    import importlib.metadata
    import importlib.util

    for dist in MOONCAKE_HOST_DISTS + MOONCAKE_CUDA_DISTS:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if dist in MOONCAKE_HOST_DISTS:
            return False, f"{dist} {version} is Mooncake's build without CUDA: it cannot register GPU memory"
        return True, f"{dist} {version} is a CUDA build of Mooncake"
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return False, f"Mooncake is not installed; {_INSTALL_HINT}"
    engine = os.path.join(list(spec.submodule_search_locations)[0], "engine.so")
    try:
        with open(engine, "rb") as f:
            blob = f.read()
    except OSError as exc:
        return False, f"cannot read Mooncake's engine ({exc})"
    if any(sym in blob for sym in _CUDA_SYMBOLS):
        return True, f"{engine} links the CUDA runtime"
    return False, f"{engine} does not link the CUDA runtime (a build without CUDA)"


TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"


@contextmanager
def transfer_timeout_env(timeout_s: float | None) -> Iterator[str | None]:
    """While one engine starts, make Mooncake give up on a stuck write about when our own deadline fires (it
    waits 30 s by default), so a thread blocked on a frozen peer does not linger much past the push's failure.
    Measured on tcp: a frozen peer fails after max(MC_TRANSFER_TIMEOUT, ~5) s; the writer's own deadline is
    exact. Mooncake's Python API takes no timeout, but its engine reads the variable when it is built, so it is
    set only around that and restored after (the process environment is left as found); a value the user
    exported wins. Yields the value the engine sees (None: Mooncake's default). Hold _ENGINE_START_LOCK."""
    user = os.environ.get(TIMEOUT_ENV)
    if user is not None or timeout_s is None:
        yield user
        return
    value = str(max(1, math.ceil(timeout_s)))
    with environment_set({TIMEOUT_ENV: value}):
        yield value


class MooncakeTransport:
    """A Mooncake TransferEngine in P2PHANDSHAKE mode; its session id is `hostname:rpc_port`."""

    def __init__(
        self,
        hostname: str,
        protocol: str = "rdma",
        device_name: str = "",
        timeout_s: float | None = None,
    ) -> None:
        TransferEngine = import_transfer_engine()
        with _ENGINE_START_LOCK, transfer_timeout_env(timeout_s) as engine_timeout:
            self._engine = TransferEngine()
            rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        self.transfer_timeout = engine_timeout  # MC_TRANSFER_TIMEOUT this engine was built with (None: Mooncake's)
        check_rc(
            rc,
            f"Mooncake TransferEngine.initialize(hostname={hostname!r}, protocol={protocol!r}, "
            f"device_name={device_name!r})",
            "check the hostname is this node's reachable address and the RDMA device names (p2p device_name)",
        )
        self.hostname = hostname
        self.protocol = protocol
        self._session_id = f"{hostname}:{self._engine.get_rpc_port()}"

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, addr: int, nbytes: int) -> None:
        check_rc(self._engine.register_memory(addr, nbytes), f"Mooncake register_memory({addr:#x}, {nbytes})")

    def unregister(self, addr: int) -> None:
        check_rc(self._engine.unregister_memory(addr), f"Mooncake unregister_memory({addr:#x})")

    def write(
        self, session_id: str, local_addrs: Sequence[int], remote_addrs: Sequence[int], lengths: Sequence[int]
    ) -> None:
        if not lengths:
            return
        started = time.monotonic()
        rc = self._engine.batch_transfer_sync_write(session_id, list(local_addrs), list(remote_addrs), list(lengths))
        check_rc(
            rc,
            f"Mooncake batch write of {len(lengths)} ranges ({sum(lengths)} bytes) to session {session_id}",
            self._failed_call_hint(time.monotonic() - started),
        )

    def read(
        self, session_id: str, local_addrs: Sequence[int], remote_addrs: Sequence[int], lengths: Sequence[int]
    ) -> None:
        """Read remote ranges into registered local memory (opens the session's segment and connection)."""
        if not lengths:
            return
        started = time.monotonic()
        rc = self._engine.batch_transfer_sync_read(session_id, list(local_addrs), list(remote_addrs), list(lengths))
        check_rc(
            rc,
            f"Mooncake batch read of {len(lengths)} ranges ({sum(lengths)} bytes) from session {session_id}",
            self._failed_call_hint(time.monotonic() - started),
        )

    def _failed_call_hint(self, elapsed_s: float) -> str:
        """Why a call failed, with its duration beside the engine's timeout: a call that outlived the timeout
        failed on it, which a frozen peer causes but so does this process being stopped (SIGSTOP, a debugger)."""
        timeout = f"{self.transfer_timeout} s" if self.transfer_timeout else "Mooncake's default"
        return (
            f"it returned after {elapsed_s:.1f} s (transfer timeout {timeout}): the peer is gone, frozen or "
            "unreachable, or, where the call outlived the timeout, this process itself was stopped past it"
        )

    def __repr__(self) -> str:
        return f"MooncakeTransport(session_id={self._session_id!r}, protocol={self.protocol!r})"

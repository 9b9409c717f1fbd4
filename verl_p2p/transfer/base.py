"""The transport seam: one-sided writes of byte ranges into a remote session's registered memory.

A transport knows addresses, lengths and session ids, never model or parameter names: the writer turns
parameter names into addresses before calling it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from verl_p2p.errors import TransferError


@runtime_checkable
class Transport(Protocol):
    """What the writer and the transfer buffers need from Mooncake (or NIXL)."""

    @property
    def session_id(self) -> str:
        """This endpoint's id as peers address it (Mooncake: `host:rpc_port`)."""
        ...

    def register(self, addr: int, nbytes: int) -> None:
        """Make `[addr, addr + nbytes)` readable by this endpoint's writes; raise TransferError on failure."""
        ...

    def unregister(self, addr: int) -> None:
        """Undo `register(addr, ...)`; raise TransferError on failure."""
        ...

    def write(
        self, session_id: str, local_addrs: Sequence[int], remote_addrs: Sequence[int], lengths: Sequence[int]
    ) -> None:
        """Write local ranges into `session_id`'s registered memory and return once done; raise TransferError
        when the transport reports failure (the remote bytes are then unknown)."""
        ...


def check_rc(rc: int, what: str, fix: str = "") -> None:
    """Turn a transport's negative return code into a TransferError that says what failed."""
    if rc < 0:
        raise TransferError(f"{what} failed (return code {rc})" + (f": {fix}" if fix else ""))


class TransportProxy:
    """A transport that hands every call to `inner`: the base of wrappers that change only `write` (a fault on
    chosen sessions, a record of calls), so each keeps the seam's other calls without writing them again."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, addr: int, nbytes: int) -> None:
        self.inner.register(addr, nbytes)

    def unregister(self, addr: int) -> None:
        self.inner.unregister(addr)

    def write(
        self, session_id: str, local_addrs: Sequence[int], remote_addrs: Sequence[int], lengths: Sequence[int]
    ) -> None:
        return self.inner.write(session_id, local_addrs, remote_addrs, lengths)

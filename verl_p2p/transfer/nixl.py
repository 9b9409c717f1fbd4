"""NIXL transport seam (optional; `engine_kwargs.verl_p2p.transport=nixl`).

Not available in this build. Two things are missing, not just the package: SGLang's rollout ranks publish
Mooncake session ids and register their weights with Mooncake only, so a NIXL writer would also need a
rollout-side NIXL agent publishing its metadata; and the `nixl` wheel (UCX backend) was installable on the
CPU development host but its peer-to-peer metadata exchange could not be exercised there. The class keeps
the Transport interface's place so a working implementation can drop in without touching the writer.
"""

from __future__ import annotations

from collections.abc import Sequence

from verl_p2p.errors import TransferError


def nixl_importable() -> bool:
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True


class NixlTransport:
    """Placeholder with the Transport interface; constructing it explains what to use instead."""

    def __init__(self, hostname: str, *args, **kwargs) -> None:
        if not nixl_importable():
            raise TransferError(
                "NIXL transport unavailable here: install nixl (`pip install nixl`, CUDA hosts), and note the "
                "rollout side must run NIXL agents too; use engine_kwargs.verl_p2p.transport=mooncake (the default)"
            )
        raise TransferError(
            "NIXL transport unavailable here: the nixl package is importable, but SGLang rollout ranks publish "
            "Mooncake sessions only and this build has no NIXL writer; use engine_kwargs.verl_p2p.transport=mooncake"
        )

    @property
    def session_id(self) -> str:  # pragma: no cover - never constructed
        raise TransferError("NIXL transport unavailable")

    def register(self, addr: int, nbytes: int) -> None:  # pragma: no cover
        raise TransferError("NIXL transport unavailable")

    def unregister(self, addr: int) -> None:  # pragma: no cover
        raise TransferError("NIXL transport unavailable")

    def write(
        self, session_id: str, local_addrs: Sequence[int], remote_addrs: Sequence[int], lengths: Sequence[int]
    ) -> None:  # pragma: no cover
        raise TransferError("NIXL transport unavailable")

"""Transfer layer: the transport seam (Mooncake; NIXL placeholder), two registered buffer slots per source,
and per-target write lanes with deadlines and validation."""

from __future__ import annotations

from verl_p2p.transfer.base import Transport


def make_transport(config, hostname: str) -> Transport:
    """The transport `config.transport` names (a `P2PConfig`), with its protocol, device and timeout."""
    if config.transport == "mooncake":
        from verl_p2p.transfer.mooncake import MooncakeTransport

        return MooncakeTransport(hostname, config.protocol, config.device_name, timeout_s=config.p2p_transfer_timeout)
    if config.transport == "nixl":
        from verl_p2p.transfer.nixl import NixlTransport

        return NixlTransport(hostname)
    raise ValueError(f"unknown transport {config.transport!r}; choose 'mooncake' or 'nixl'")


__all__ = ["Transport", "make_transport"]

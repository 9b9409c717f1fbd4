"""Transport selection and the errors a missing transport gives (no processes, no network)."""

from __future__ import annotations

import os
import sys

import pytest

from verl_p2p.config import P2PConfig
from verl_p2p.errors import TransferError
from verl_p2p.transfer import make_transport, mooncake
from verl_p2p.transfer.base import Transport, check_rc
from verl_p2p.transfer.mooncake import TIMEOUT_ENV, MooncakeTransport, import_transfer_engine


def test_nixl_seam_says_what_to_use_instead():
    with pytest.raises(TransferError, match="NIXL transport unavailable here.*transport=mooncake"):
        make_transport(P2PConfig(transport="nixl"), "127.0.0.1")


def test_missing_mooncake_names_the_packages(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import fails as on a host without Mooncake
    with pytest.raises(TransferError) as err:
        import_transfer_engine()
    msg = str(err.value)
    assert "mooncake-transfer-engine" in msg and "mooncake-transfer-engine-non-cuda" in msg


def test_negative_return_code_raises_with_context():
    check_rc(0, "ok")
    with pytest.raises(TransferError, match=r"write to s failed \(return code -1\): peer gone"):
        check_rc(-1, "write to s", "peer gone")


def _seen_by_the_engine(monkeypatch) -> list:
    """The real TransferEngine, recording MC_TRANSFER_TIMEOUT as it is built and initialized."""
    seen = []
    real = import_transfer_engine()

    class Recording(real):
        def __init__(self):
            seen.append(os.environ.get(TIMEOUT_ENV))
            super().__init__()

        def initialize(self, *args):
            seen.append(os.environ.get(TIMEOUT_ENV))
            return super().initialize(*args)

    monkeypatch.setattr(mooncake, "import_transfer_engine", lambda: Recording)
    return seen


def test_mooncake_transport_is_a_transport(monkeypatch):
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    seen = _seen_by_the_engine(monkeypatch)
    transport = make_transport(P2PConfig(protocol="tcp", p2p_transfer_timeout=7.5), "127.0.0.1")
    assert isinstance(transport, MooncakeTransport) and isinstance(transport, Transport)
    host, port = transport.session_id.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert seen == ["8", "8"] and transport.transfer_timeout == "8"  # gives up about when our deadline fires
    assert TIMEOUT_ENV not in os.environ  # only the engine's start saw it: the process environment is untouched


def test_a_transfer_timeout_the_user_exported_wins(monkeypatch):
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    monkeypatch.setenv(TIMEOUT_ENV, "123")
    seen = _seen_by_the_engine(monkeypatch)
    transport = make_transport(P2PConfig(protocol="tcp", p2p_transfer_timeout=7.5), "127.0.0.1")
    assert seen == ["123", "123"] and transport.transfer_timeout == "123"
    assert os.environ[TIMEOUT_ENV] == "123"

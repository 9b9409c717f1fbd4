"""Fixtures shared by the control-plane tests."""

from __future__ import annotations

import pytest
from support.fake_sglang import FakeSGLang


@pytest.fixture
def fakes():
    """`fakes(n, **options)` starts n stand-in SGLang servers (tests/support/fake_sglang.py); all stop after."""
    servers: list[FakeSGLang] = []

    def make(n: int, **kwargs) -> list[FakeSGLang]:
        new = [FakeSGLang(**kwargs) for _ in range(n)]
        servers.extend(new)
        return new

    yield make
    for server in servers:
        server.stop()

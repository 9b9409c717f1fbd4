"""Fixtures shared by the control-plane tests."""

from __future__ import annotations

import os

import pytest
from support.fake_sglang import FakeSGLang

# Every local Ray cluster of the suite starts with token authentication off, in every test process. Ray 2.60 turns
# tokens on for a `ray.init()` that finds RAY_AUTH_MODE unset and caches that mode in the process: a module that
# then set "disabled" for its own cluster started a GCS without tokens under a driver that demanded them, and verl's
# actors were cancelled before they ran (test_push_deadline then test_verl_e2e in one xdist worker).
os.environ["RAY_AUTH_MODE"] = "disabled"


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

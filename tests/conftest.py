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


def pytest_collection_modifyitems(config, items):
    """Modules with multi-process (`slow`) tests first, each module's tests kept together and in order.

    `make test` runs two pytest-xdist workers, each taking whole modules in collection order (`--dist loadfile`:
    a module's witnesses and rank processes are built once, on one worker). With the long modules last, one worker
    ran the final ones alone while the other sat idle; handing them out first balances the two."""
    first_seen: dict[str, int] = {}
    slow: set[str] = set()
    for index, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::")[0], index)
        if item.get_closest_marker("slow") is not None:
            slow.add(item.nodeid.split("::")[0])
    items.sort(key=lambda item: (item.nodeid.split("::")[0] not in slow, first_seen[item.nodeid.split("::")[0]]))

"""Fixtures shared by the control-plane tests."""

from __future__ import annotations

import pytest
from support.fake_sglang import FakeSGLang

# Modules that start a local Ray cluster of their own (in the test process or a subprocess). `make test` runs two
# pytest-xdist workers; two Ray clusters starting at once on a 2-core host lost an actor before it ran (CI, stop 38:
# "The actor never ran - it was cancelled before it started running"), so these modules share one worker's queue.
RAY_CLUSTER_MODULES = frozenset(
    {"test_verl_e2e.py", "test_push_deadline.py", "test_grpo_check.py", "test_tiny_recipe.py"}
)


def xdist_group_of(module_name: str, module_path: str) -> str:
    """The pytest-xdist group of a module's tests (`--dist loadgroup`): its own file, as `--dist loadfile` would,
    except that every Ray-cluster module is one group, run one after another on one worker."""
    return "ray-clusters" if module_name in RAY_CLUSTER_MODULES else module_path


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group_of(item.path.name, item.nodeid.split("::")[0])))


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

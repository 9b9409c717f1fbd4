"""Fixtures shared by the control-plane tests."""

from __future__ import annotations

import os

import pytest
from support import replica_matrix
from support.fake_sglang import FakeSGLang

# Every local Ray cluster of the suite starts with token authentication off, in every test process. Ray 2.60 turns
# tokens on for a `ray.init()` that finds RAY_AUTH_MODE unset and caches that mode in the process: a module that
# then set "disabled" for its own cluster started a GCS without tokens under a driver that demanded them, and verl's
# actors were cancelled before they ran (test_push_deadline then test_verl_e2e in one xdist worker).
os.environ["RAY_AUTH_MODE"] = "disabled"

# Modules in the order `make test` hands them to its two pytest-xdist workers (`--dist loadfile
# --no-loadscope-reorder`: whole modules, in collection order): the longest first, so neither worker is left with
# a long module at the end while the other idles (ranked by a module's summed test times in a full run); every
# module not named here follows in its own order. test_replica_exact.py builds the shared SGLang witnesses
# (support/replica_matrix.py) early; the other modules reading them come late, when the builds are done.
LONGEST_FIRST = (
    "test_push_deadline.py",
    "test_stalled_rank_export.py",
    "test_manager_stalled_export.py",
    "test_loopback_post_load.py",
    "test_fsdp_source.py",
    "test_replica_exact.py",
    "test_demo_e2e.py",
    "test_scripts.py",
    "test_e2e_loopback.py",
    "test_gpu_verl_replica.py",
    "test_real_sizes.py",
    "test_soak.py",
    "test_fsdp_bf16_rollout.py",
    "test_export_pp_local.py",
    "test_e2e_generations.py",
    "test_plan_cache.py",
    "test_sync_e2e.py",
    "test_soak_leaks.py",
    "test_verl_e2e.py",
    "test_fsdp_refusals.py",
    "test_manager_transient_write.py",
    "test_sync_failures.py",
    "test_replica_exact_models.py",
    "test_tiny_recipe.py",
    "test_registration.py",
    "test_replica_cpu_host.py",
    "test_router_bias_sync.py",
    "test_replica_exact_casts.py",
    "test_replica_fp8.py",
    "test_replica_fp8_mla.py",
)


def pytest_collection_modifyitems(config, items):
    """Modules named in LONGEST_FIRST first, in that order; each module's tests kept together and in order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.path.name, index)
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), first_seen[item.path.name]))


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


@pytest.fixture(scope="session")
def replica_witnesses(tmp_path_factory):
    """`replica_witnesses(request, matrix)`: the module's declared witness jobs (support/replica_matrix.py) built
    for the releases its selected tests take, once per release for the whole session and both xdist workers."""
    root = replica_matrix.session_dir(tmp_path_factory)

    def prepare(request, matrix: replica_matrix.Matrix) -> replica_matrix.Matrix:
        return matrix.prepare(root, replica_matrix.needed_versions(request))

    return prepare


def pytest_collection_finish(session):
    """The shared witness builds cover only the modules with selected tests."""
    replica_matrix.ACTIVE = {item.module.__name__ for item in session.items if hasattr(item, "module")}

"""`make test` runs pytest-xdist with `--dist loadgroup`: every module is one group (its module-scoped witnesses are
built once), and the modules that start a Ray cluster share one group so that no two clusters start at once."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import RAY_CLUSTER_MODULES, xdist_group_of

TESTS = Path(__file__).resolve().parent


def test_every_module_that_starts_a_ray_cluster_is_in_the_ray_group():
    starts = {p.name for p in TESTS.glob("test_*.py") if re.search(r"\bray\.init\(", p.read_text())}
    assert starts == set(RAY_CLUSTER_MODULES)


def test_other_modules_are_grouped_by_file_and_ray_modules_together():
    assert xdist_group_of("test_stream.py", "tests/test_stream.py") == "tests/test_stream.py"
    groups = {xdist_group_of(name, f"tests/{name}") for name in RAY_CLUSTER_MODULES}
    assert groups == {"ray-clusters"}


def test_make_test_distributes_by_group():
    makefile = (TESTS.parent / "Makefile").read_text()
    assert "--dist loadgroup" in makefile and "--dist loadfile" not in makefile

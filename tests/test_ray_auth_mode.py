"""The suite's Ray clusters share one authentication mode (tests/conftest.py): a test process that starts several
clusters one after another must never switch it (Ray caches the first cluster's mode in the process)."""

from __future__ import annotations

import os
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
QUOTED_NAME = re.compile(r"""["']RAY_AUTH_MODE["']""")


def test_the_suite_sets_ray_auth_mode_once_before_any_cluster():
    assert os.environ.get("RAY_AUTH_MODE") == "disabled"
    setters = sorted(
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("*.py")
        if p.name not in ("conftest.py", Path(__file__).name) and re.search(QUOTED_NAME, p.read_text())
    )
    assert setters == [], f"only tests/conftest.py sets RAY_AUTH_MODE; also set in {setters}"

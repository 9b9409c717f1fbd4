"""Process environment variables set for the span of a `with` block, then put back as they were.

Some libraries read their settings from the process environment only when they build something (SGLang while it
builds a model, Mooncake when an engine starts): p2p sets those variables around that one step and leaves the
environment as it found it. Not thread-safe (the environment is process-wide): callers hold their own lock.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def environment_set(settings: Mapping[str, str | None]) -> Iterator[None]:
    """The process environment with `settings` while inside (None: the variable unset), each variable restored
    (or removed) on exit."""
    saved = {k: os.environ.get(k) for k in settings}
    for k, v in settings.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

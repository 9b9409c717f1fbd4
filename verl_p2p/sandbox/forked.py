"""Test process groups forked from a preloaded template instead of spawned as fresh interpreters.

A spawned rank of a CPU test world spends most of its CPU importing torch, Megatron-Bridge and SGLang before its
few milliseconds of work. Python's forkserver start method keeps one template process per parent that imports
`group_preload` once; every rank is forked from it with those modules already imported. A forked rank would
otherwise have the template's environment, so each gets the parent's environment as it was when the rank was
created, as a spawned one does.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

PRELOAD = ["verl_p2p.sandbox.group_preload"]


def context() -> BaseContext:
    """The forkserver context with the template's preload set (it takes effect when the template starts)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def process(target: Callable[..., Any], args: tuple = (), **kwargs: Any) -> BaseProcess:
    """An unstarted process of `context()` running `target(*args)` in this process's current environment."""
    return context().Process(target=_in_env, args=(dict(os.environ), target, args), **kwargs)


def _in_env(env: dict[str, str], target: Callable[..., Any], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)

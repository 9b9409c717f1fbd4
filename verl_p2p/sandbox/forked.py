"""CPU process groups (test worlds, the loopback rollout's ranks) forked from a preloaded template instead of
spawned as fresh interpreters.

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


def context(preload: list[str] = PRELOAD) -> BaseContext:
    """The forkserver context with the template's preload set. One template serves a process: the preload of the
    first call that starts it holds (a later caller's ranks import the rest themselves, as spawned ones would)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    return ctx


def process(target: Callable[..., Any], args: tuple = (), preload: list[str] = PRELOAD, **kwargs: Any) -> BaseProcess:
    """An unstarted process of `context()` running `target(*args)` in this process's current environment."""
    return context(preload).Process(target=_in_env, args=(dict(os.environ), target, args), **kwargs)


def _in_env(env: dict[str, str], target: Callable[..., Any], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)

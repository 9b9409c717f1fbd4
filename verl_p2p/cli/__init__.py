"""`verl-p2p <command>`: the command line's front door (one module per command, imported only when run).

This module imports nothing heavy, so `--help`, `--version` and a mistyped command answer at once; each command
module imports torch, SGLang, verl or Megatron only after parsing, so its own `--help` does too. A reader that
closes the pipe early (`verl-p2p -h | head -2`) ends the command quietly instead of with a traceback.
"""

from __future__ import annotations

import importlib
import os
import select
import sys
from dataclasses import dataclass

USAGE_ERROR = 2  # argparse's exit status for a usage error; every command uses it
HELP = ("-h", "--help", "help")


@dataclass(frozen=True)
class Command:
    """One `verl-p2p` command: the module whose `main(argv)` runs it and the line `--help` shows."""

    name: str
    module: str
    summary: str
    function: str = "main"  # the module's `function(argv)` runs the command


COMMANDS = (
    Command("demo", "verl_p2p.cli.demo", "whole syncs on CPU into two loopback SGLang engines, checked bit for bit"),
    Command("plan", "verl_p2p.cli.plan", "which trainer rank writes which rollout rank, bytes and a predicted time"),
    Command("bench", "verl_p2p.cli.bench", "push a synthetic >= 1 GB model over Mooncake, beside raw Mooncake writes"),
    Command("e2e", "verl_p2p.e2e.run", "prove whole syncs into a real rollout, drill failures, write a JSON report"),
    Command("soak", "verl_p2p.cli.soak", "hundreds of syncs against loopback engines with faults injected"),
    Command(
        "serve-loopback",
        "verl_p2p.loopback.__main__",
        "serve one loopback engine (SGLang's model classes on CPU) until interrupted",
        function="serve_main",
    ),
)
BY_NAME = {c.name: c for c in COMMANDS}


def package_version() -> str:
    from verl_p2p import __version__

    return __version__


def help_text() -> str:
    width = max(len(c.name) for c in COMMANDS)
    lines = [
        "usage: verl-p2p <command> [options]    (verl-p2p --version prints the version)",
        "",
        "verl-p2p syncs a verl trainer's weights (Megatron or FSDP) into SGLang rollout ranks over Mooncake writes.",
        "",
        "commands:",
        *(f"  {c.name:<{width}}  {c.summary}" for c in COMMANDS),
        "",
        "Run 'verl-p2p <command> --help' for a command's options.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            status = _dispatch(argv)
        except SystemExit:  # argparse's --help and usage errors: flushed here too, then passed on
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # here, where a closed pipe can still be caught
        return status
    except BrokenPipeError:
        closed = _closed_stdout_fds()
        if not closed:
            raise  # a pipe of the command's own (a child process, a socket) broke: a real failure
        return _reader_gone(argv, closed)


def _closed_stdout_fds() -> list[int]:
    """The descriptors behind stdout (and a quiet run's console stream) whose reader has closed the pipe."""
    closed = []
    for stream in (sys.stdout, getattr(sys.stdout, "console", None)):
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):  # no descriptor of its own (a test's capture)
            continue
        poller = select.poll()
        poller.register(fd, 0)  # POLLERR is always reported: on a pipe's write end, its reader has gone
        if any(event & select.POLLERR for _, event in poller.poll(0)):
            closed.append(fd)
    return closed


def _reader_gone(argv: list[str], closed: list[int]) -> int:
    """stdout's reader closed the pipe (`verl-p2p -h | head -2`): no traceback, and no second error when Python
    flushes stdout at exit (those descriptors now write to /dev/null). Help was asked for and given as far as it
    was read: 0; a command cut short: 141, what a shell reports when SIGPIPE ends one."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in closed:
        os.dup2(devnull, fd)
    os.close(devnull)
    asked_for_help = bool(argv) and (argv[0] in HELP or any(a in ("-h", "--help") for a in argv[1:]))
    return 0 if asked_for_help else 128 + 13


def _dispatch(argv: list[str]) -> int:
    if not argv:
        print(help_text(), file=sys.stderr)
        return USAGE_ERROR
    first, rest = argv[0], argv[1:]
    if first in HELP:
        print(help_text())
        return 0
    if first in ("-V", "--version"):
        print(f"verl-p2p {package_version()}")
        return 0
    command = BY_NAME.get(first)
    if command is None:
        what = "option" if first.startswith("-") else "command"
        print(
            f"verl-p2p: error: unknown {what} {first!r}; the commands are {', '.join(BY_NAME)} "
            "(verl-p2p --help lists them)",
            file=sys.stderr,
        )
        return USAGE_ERROR
    return int(getattr(importlib.import_module(command.module), command.function)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""`verl-p2p <command>`: the command line's front door (one module per command, imported only when run).

This module imports nothing heavy, so `--help`, `--version` and a mistyped command answer at once.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

USAGE_ERROR = 2  # argparse's exit status for a usage error; every command uses it


@dataclass(frozen=True)
class Command:
    """One `verl-p2p` command: the module whose `main(argv)` runs it and the line `--help` shows."""

    name: str
    module: str
    summary: str
    fixed_args: tuple[str, ...] = ()  # put before the user's arguments (a module with a sub-command)


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
        fixed_args=("serve",),
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
        "verl-p2p syncs Megatron trainer weights into SGLang rollout ranks over Mooncake writes.",
        "",
        "commands:",
        *(f"  {c.name:<{width}}  {c.summary}" for c in COMMANDS),
        "",
        "Run 'verl-p2p <command> --help' for a command's options.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(help_text(), file=sys.stderr)
        return USAGE_ERROR
    first, rest = argv[0], argv[1:]
    if first in ("-h", "--help", "help"):
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
    return int(importlib.import_module(command.module).main([*command.fixed_args, *rest]) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""`verl-p2p demo | plan | bench | e2e | soak | serve-loopback`: the command line (one module per command)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "demo": "verl_p2p.cli.demo",
        "plan": "verl_p2p.cli.plan",
        "bench": "verl_p2p.cli.bench",
        "soak": "verl_p2p.cli.soak",
        "serve-loopback": "verl_p2p.loopback.__main__",
        "e2e": "verl_p2p.e2e.run",
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: verl-p2p {demo,plan,bench,e2e,soak,serve-loopback} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    import importlib

    return int(importlib.import_module(commands[command]).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""`verl-p2p demo | plan | bench | soak | serve-loopback`: the command-line entry points (one module per command)."""

from __future__ import annotations

import argparse
import sys


def _plan(argv: list[str]) -> int:
    from verl_p2p.planning.plan import SourceRank, build_transfer_plan
    from verl_p2p.planning.targets import TargetRank

    parser = argparse.ArgumentParser(prog="verl-p2p plan", description="Print the transfer plan for a shape.")
    parser.add_argument("--sources-per-stage", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--engines", default="2,2", help="ranks per rollout engine, comma separated")
    args = parser.parse_args(argv)
    sources = [
        SourceRank(global_rank=s * args.sources_per_stage + i, pp_stage=s)
        for s in range(args.pp)
        for i in range(args.sources_per_stage)
    ]
    targets = [TargetRank(e, r) for e, n in enumerate(int(x) for x in args.engines.split(",")) for r in range(n)]
    print(build_transfer_plan(sources, targets).describe())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "demo": "verl_p2p.cli.demo",
        "bench": "verl_p2p.cli.bench",
        "soak": "verl_p2p.cli.soak",
        "serve-loopback": "verl_p2p.loopback.__main__",
        "e2e": "verl_p2p.e2e.run",
    }
    if not argv or argv[0] in ("-h", "--help") or (argv[0] not in commands and argv[0] != "plan"):
        print("usage: verl-p2p {demo,plan,bench,e2e,soak,serve-loopback} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "plan":
        return _plan(rest)
    import importlib

    return int(importlib.import_module(commands[command]).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""`verl-p2p soak`: hundreds of syncs, a fault injected every few syncs; one command for both soaks.

Without `--rollout`: this process drives loopback engines in a child process through a stand-in trainer
(verl_p2p/e2e/loopback_soak.py). With `--rollout sglang|loopback`: a trainer process syncs into one rollout server
(verl_p2p/e2e/soak.py). Both sample resources with and judge leaks by verl_p2p/e2e/leaks.py (`--leak-*`), write JSON
(`--out`), print a summary, and exit 1 when anything was not as predicted or a process leaked.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from verl_p2p.cli.help import parser as command_parser
from verl_p2p.e2e.leaks import LeakLimit, LeakLimits
from verl_p2p.e2e.loopback_soak import FAULTS, SoakOptions, run_soak

__all__ = ["FAULTS", "SoakOptions", "build_parser", "main", "run_soak"]


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("verl-p2p soak", __doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=200, help="syncs to run")
    parser.add_argument("--fault-every", type=int, default=10, help="every N-th sync gets the next fault (0: none)")
    parser.add_argument("--warmup", type=int, default=20, help="syncs before resource growth is measured")
    parser.add_argument(
        "--http-timeout", type=float, default=None, help="seconds per control call (default: 5; 10 with --rollout)"
    )
    parser.add_argument(
        "--transfer-timeout", type=float, default=None, help="seconds per push (default: 2; 3 with --rollout)"
    )
    parser.add_argument("--engines", default="2:2,1:1,1:1", help="loopback engines as tp:ep, comma separated")
    parser.add_argument("--out", default=None, help="write the JSON report here (default: none, no file)")
    defaults = LeakLimits()
    leak = parser.add_argument_group(
        "leak limits",
        "after --warmup, a process whose RSS, fds or threads grow faster than this per 100 syncs (least squares, "
        "per process instance) and by more than the floor in all fails the soak",
    )
    for key, unit in (("rss_mb", "MB"), ("fds", "fds"), ("threads", "threads")):
        limit = getattr(defaults, key)
        leak.add_argument(
            f"--leak-{key.replace('_', '-')}-per-100",
            type=float,
            default=limit.per_100_syncs,
            help=f"{unit} per 100 syncs (default: {limit.per_100_syncs}; floor {limit.floor})",
        )
    real = parser.add_argument_group(
        "trainer process into one rollout server (--rollout)",
        "faults: trainer killed, wrong session, scheduler frozen, server restarted (verl_p2p/e2e/soak.py)",
    )
    real.add_argument(
        "--rollout",
        choices=("sglang", "loopback"),
        default=None,
        help="run that soak instead (default: none: loopback engines in a child process, driven from this one)",
    )
    real.add_argument(
        "--max-restarts", type=int, default=None, help="most restarts per restarting fault kind (default: no cap)"
    )
    real.add_argument("--model", choices=("qwen3", "qwen3_moe"), default="qwen3", help="model the rollout serves")
    real.add_argument(
        "--size", choices=("tiny", "gpu"), default=None, help="model shape (default: gpu for sglang, tiny for loopback)"
    )
    real.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="start no sync after this many seconds, reported (default: none, every sync runs)",
    )
    real.add_argument(
        "--probe-timeout", type=float, default=2.0, help="seconds within which a stale rollout must not answer"
    )
    real.add_argument(
        "--generate-every", type=int, default=1, help="compare generations every N-th sync (and around faults)"
    )
    real.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help="SGLang --mem-fraction-static (default: computed from the GPU and the model's bytes; loopback ignores it)",
    )
    real.add_argument(
        "--workdir",
        default=None,
        help="keep the checkpoints and server logs here (default: a temporary directory, removed after)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fault_every == 1:
        parser.error("--fault-every must be 0 or >= 2: a faulted sync is followed by one that must recover")
    limits = _leak_limits(args, parser)
    command = "verl-p2p soak " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.rollout is not None:
        return _main_real(args, command.strip(), limits)
    args.http_timeout = 5.0 if args.http_timeout is None else args.http_timeout
    args.transfer_timeout = 2.0 if args.transfer_timeout is None else args.transfer_timeout
    options = SoakOptions(
        syncs=args.syncs,
        fault_every=args.fault_every,
        warmup=args.warmup,
        http_timeout=args.http_timeout,
        transfer_timeout=args.transfer_timeout,
        engines=tuple(tuple(int(x) for x in e.split(":")) for e in args.engines.split(",")),
        out=args.out,
        command=command.strip(),
        leak_limits=limits,
    )
    report = run_soak(options)
    res = report["resources"]
    print(
        f"[soak] {report['syncs']} syncs in {report['seconds_total']} s: {report['passed']} passed, "
        f"{report['failed']} failed; faults {report['faults_as_predicted']}/{report['faults_injected']} as predicted, "
        f"{report['faults_named_correctly']} named correctly; stale replicas resumed: "
        f"{report['stale_replicas_resumed']}; violations: {sum(report['violations'].values())}"
    )
    print(
        f"[soak] after warm-up: rss {res['rss_mb']['after_warmup']:.1f} -> {res['rss_mb']['final']:.1f} MB "
        f"({res['rss_mb']['per_100_syncs']} MB/100 syncs), fds {res['fds']['after_warmup']} -> "
        f"{res['fds']['final']}, threads {res['threads']['after_warmup']} -> {res['threads']['final']}"
    )
    return _verdict(report)


def _verdict(report: dict[str, Any]) -> int:
    """Print what went wrong (unexpected outcomes, leaks); the exit status."""
    if report.get("error"):
        print(f"[soak] ERROR: {report['error']}")
    for problem in report["unexpected"][:20]:
        print(f"[soak] UNEXPECTED: {problem}")
    for leak in report["leaks"]:
        print(f"[soak] LEAK: {leak}")
    return 0 if report["ok"] else 1


def _leak_limits(args: argparse.Namespace, parser: argparse.ArgumentParser) -> LeakLimits:
    """The leak limits the options name (floors as documented); a negative limit is refused."""
    defaults, limits = LeakLimits(), {}
    for key in ("rss_mb", "fds", "threads"):
        value = getattr(args, f"leak_{key}_per_100")
        if value < 0:
            parser.error(f"--leak-{key.replace('_', '-')}-per-100 must be >= 0 (growth per 100 syncs), got {value}")
        limits[key] = LeakLimit(value, getattr(defaults, key).floor)
    return LeakLimits(**limits)


def _main_real(args: argparse.Namespace, command: str, limits: LeakLimits) -> int:
    """`--rollout`: the trainer-process soak into one rollout server (verl_p2p/e2e/soak.py)."""
    from verl_p2p.e2e.mem_fraction import MemFractionError
    from verl_p2p.e2e.soak import RealSoakOptions, run_real_soak

    options = RealSoakOptions(
        rollout=args.rollout,
        syncs=args.syncs,
        fault_every=args.fault_every,
        warmup=args.warmup,
        max_restarts=args.max_restarts,
        model=args.model,
        size=args.size,
        transfer_timeout=3.0 if args.transfer_timeout is None else args.transfer_timeout,
        http_timeout=10.0 if args.http_timeout is None else args.http_timeout,
        probe_timeout=args.probe_timeout,
        mem_fraction=args.mem_fraction,
        time_budget_s=args.time_budget_s,
        generate_every=max(1, args.generate_every),
        workdir=args.workdir,
        out=args.out,
        command=command,
        leak_limits=limits,
    )
    try:
        report = run_real_soak(options)
    except MemFractionError as exc:  # before any checkpoint or server: the numbers and the ways out
        print(f"[soak] {exc}", file=sys.stderr)
        return 2
    print(
        f"[soak] {report['rollout']}: {report['syncs']} syncs in {report['seconds_total']} s: {report['passed']} "
        f"passed, {report['failed']} failed; faults {report['faults_as_predicted']}/{report['faults_injected']} as "
        f"predicted ({report['faults_by_kind']}), {report['faults_named_correctly']} named correctly; stale "
        f"replicas resumed: {report['stale_replicas_resumed']}"
    )
    print(f"[soak] slopes per 100 syncs after warm-up: {json.dumps(report['slopes_after_warmup'])}")
    return _verdict(report)


if __name__ == "__main__":
    sys.exit(main())

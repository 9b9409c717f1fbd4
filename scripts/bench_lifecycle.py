"""Control-plane overhead of one sync (everything but the push) over N replicas in parallel.

    .venv/bin/python scripts/bench_lifecycle.py --stand-in 4 --tp 2          # stand-in servers, own process
    .venv/bin/python scripts/bench_lifecycle.py --url http://h:p [--bootstrap-url http://h:6789] ...

`measure_overhead(adapters, ...)` is the reusable part (e.g. against the loopback rollout). The stand-in
servers run in a child process so that they do not share the measuring process's GIL. Prints a table and,
with --json, writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verl_p2p.config import P2PConfig  # noqa: E402
from verl_p2p.rollout.adapter import P2PReplicaAdapter  # noqa: E402
from verl_p2p.rollout.lifecycle import SyncLifecycle  # noqa: E402


async def measure_overhead(adapters, *, syncs: int = 30, warmup: int = 3, frees_kv: bool = True) -> dict:
    """Run `warmup + syncs` syncs with an empty push; the median/p90/max of each phase in milliseconds.
    The first (connecting) sync is reported apart: later syncs only re-check rank info."""
    lifecycle = SyncLifecycle(adapters, frees_kv=frees_kv)

    async def push(connection):
        return {}

    first = await lifecycle.sync(0, push)
    runs = []
    for step in range(1, warmup + syncs + 1):
        report = await lifecycle.sync(step, push)
        if step > warmup:
            runs.append(report.phases)
        assert not report.reconnected, "stand-in info changed between syncs"
    phases = {k: [r[k] * 1000 for r in runs] for k in runs[0]}
    return {
        "replicas": len(adapters),
        "ranks": sum(a.num_ranks for a in adapters),
        "syncs": syncs,
        "first_sync_ms": round(first.phases["control_plane"] * 1000, 2),
        "phases_ms": {
            k: {
                "median": round(statistics.median(v), 2),
                "p90": round(sorted(v)[int(0.9 * (len(v) - 1))], 2),
                "max": round(max(v), 2),
            }
            for k, v in phases.items()
        },
    }


_CHILD = """
import json, sys, threading
sys.path.insert(0, {tests!r})
from support.fake_sglang import FakeSGLang
fakes = [FakeSGLang(tp_size={tp}, params_per_rank={params}) for _ in range({n})]
print(json.dumps([[f.url, f.bootstrap_url] for f in fakes]), flush=True)
sys.stdin.read()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stand-in", type=int, default=0, help="launch N stand-in servers in a child process")
    parser.add_argument("--tp", type=int, default=1, help="ranks per stand-in engine")
    parser.add_argument("--params", type=int, default=500, help="parameters each stand-in rank publishes")
    parser.add_argument("--url", action="append", default=[], help="a rollout server (repeat per replica)")
    parser.add_argument("--bootstrap-url", action="append", default=[], help="its bootstrap server (same order)")
    parser.add_argument("--syncs", type=int, default=30)
    parser.add_argument("--no-release-kv", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    child = None
    urls = [(u, b) for u, b in zip(args.url, args.bootstrap_url + [None] * len(args.url), strict=False)]
    if args.stand_in:
        code = _CHILD.format(tests=str(ROOT / "tests"), tp=args.tp, params=args.params, n=args.stand_in)
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        urls = [tuple(pair) for pair in json.loads(child.stdout.readline())]
    try:
        config = P2PConfig(http_timeout=10.0)
        adapters = [P2PReplicaAdapter(i, u, bootstrap_url=b, config=config) for i, (u, b) in enumerate(urls)]
        result = asyncio.run(measure_overhead(adapters, syncs=args.syncs, frees_kv=not args.no_release_kv))
    finally:
        if child is not None:
            child.stdin.close()
            child.wait(timeout=10)
    print(f"{result['replicas']} replicas, {result['ranks']} ranks, {result['syncs']} syncs; ms per sync")
    print(f"{'phase':<14}{'median':>9}{'p90':>9}{'max':>9}")
    for name, row in result["phases_ms"].items():
        print(f"{name:<14}{row['median']:>9.2f}{row['p90']:>9.2f}{row['max']:>9.2f}")
    print(f"first sync (connect from scratch): {result['first_sync_ms']:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

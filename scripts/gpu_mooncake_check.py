"""Mooncake writes between two processes on one CUDA host, from and into GPU or pinned memory (raw transport).

Answers, before a sync depends on it, whether this Mooncake build moves bytes out of and into GPU memory over
the chosen protocol, and at what rate: the ceiling a p2p push over that protocol can reach on this host.
Each case writes `--mb` MiB from a sender buffer into a receiver buffer `--repeats` times and checks every byte.
`--cases host:host` (pageable host memory both sides) runs without a GPU: CI's smoke run of this script.

    python3 scripts/gpu_mooncake_check.py --mb 1024 --repeats 3 --out mooncake_check.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _buffer(kind: str, nbytes: int):
    import torch

    if kind == "gpu":
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")  # "host": pageable (CPU smoke)


def _receiver(kind: str, nbytes: int, protocol: str, conn) -> None:
    import torch

    from verl_p2p.e2e.rollouts import local_ip
    from verl_p2p.transfer.mooncake import MooncakeTransport

    transport = MooncakeTransport(local_ip(), protocol)
    buf = _buffer(kind, nbytes)
    buf.zero_()
    transport.register(buf.data_ptr(), nbytes)
    conn.send((transport.session_id, buf.data_ptr()))
    while conn.recv() == "check":
        if buf.is_cuda:
            torch.cuda.synchronize()
        expected = torch.arange(nbytes, dtype=torch.int64, device=buf.device).remainder_(251).to(torch.uint8)
        equal = bool(torch.equal(buf, expected))
        buf.zero_()  # before answering: the sender's next write starts on the answer, and must land after this
        if buf.is_cuda:
            torch.cuda.synchronize()
        conn.send(equal)


def run_case(src_kind: str, dst_kind: str, nbytes: int, repeats: int, protocol: str) -> dict:
    import torch

    from verl_p2p.e2e.rollouts import local_ip
    from verl_p2p.transfer.mooncake import MooncakeTransport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(dst_kind, nbytes, protocol, child), daemon=True)
    proc.start()
    try:
        session, remote = parent.recv()
        transport = MooncakeTransport(local_ip(), protocol)
        src = _buffer(src_kind, nbytes)
        src.copy_(torch.arange(nbytes, dtype=torch.int64, device=src.device).remainder_(251).to(torch.uint8))
        if src.is_cuda:
            torch.cuda.synchronize()
        transport.register(src.data_ptr(), nbytes)
        chunk = 64 << 20
        offsets = list(range(0, nbytes, chunk))
        seconds, correct = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            transport.write(
                session,
                [src.data_ptr() + o for o in offsets],
                [remote + o for o in offsets],
                [min(chunk, nbytes - o) for o in offsets],
            )
            seconds.append(time.perf_counter() - t0)
            parent.send("check")
            correct.append(parent.recv())
        parent.send("stop")
        best = min(seconds)
        return {
            "src": src_kind,
            "dst": dst_kind,
            "bytes": nbytes,
            "seconds": seconds,
            "gbps_best": nbytes / best / 1e9,
            "bytes_equal": all(correct),
        }
    except Exception as exc:  # noqa: BLE001 - a case that cannot run is reported, the others still run
        return {"src": src_kind, "dst": dst_kind, "bytes": nbytes, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        proc.kill()
        proc.join(timeout=10)


DEFAULT_CASES = ("gpu:gpu", "pinned:gpu", "gpu:pinned", "pinned:pinned")
KINDS = ("gpu", "pinned", "host")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--protocol", default="tcp")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help="comma list of src:dst among gpu, pinned, host (host:host runs without a GPU: CI's smoke run)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    nbytes = args.mb << 20
    pairs = [tuple(case.split(":")) for case in args.cases.split(",") if case]
    bad = [":".join(p) for p in pairs if len(p) != 2 or not set(p) <= set(KINDS)]
    if bad or not pairs:
        parser.error(f"--cases {bad or args.cases!r}: give src:dst pairs of {', '.join(KINDS)}")
    cases = [run_case(s, d, nbytes, args.repeats, args.protocol) for s, d in pairs]
    for c in cases:
        what = f"{c['gbps_best']:.2f} GB/s, bytes equal: {c['bytes_equal']}" if "error" not in c else c["error"]
        print(f"{c['src']:>6} -> {c['dst']:<6} {what}")
    report = {"command": "python3 " + " ".join(sys.argv), "protocol": args.protocol, "cases": cases}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if all(c.get("bytes_equal") for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())

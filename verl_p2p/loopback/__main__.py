"""`python -m verl_p2p.loopback serve --model PATH --tp 2 --ep 2 --port P --bootstrap-port B`: serve one engine.

Prints one JSON line (`url`, `bootstrap_url`, `ranks`) once every rank published its weights, then serves
until SIGINT or SIGTERM and stops every rank process.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from verl_p2p.loopback.engine import EngineSpec, LoopbackEngine


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl_p2p.loopback", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve one loopback engine until SIGINT/SIGTERM")
    serve.add_argument("--model", required=True, help="HF checkpoint directory")
    serve.add_argument("--tp", type=int, default=1)
    serve.add_argument("--ep", type=int, default=1)
    serve.add_argument("--dp-attention", type=int, default=1, help="DP-attention size (1: off)")
    serve.add_argument("--dtype", default="float32")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="control plane (default: a free port)")
    serve.add_argument("--bootstrap-port", type=int, default=None, help="bootstrap server (default: a free port)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--sglang-version", default=None, help="SGLang release to imitate (default: installed)")
    return parser


def serve(args: argparse.Namespace) -> int:
    spec = EngineSpec(
        tp=args.tp,
        ep=args.ep,
        dp_attention=args.dp_attention,
        dtype=args.dtype,
        api_key=args.api_key,
        sglang_version=args.sglang_version,
        port=args.port,
        bootstrap_port=args.bootstrap_port,
        host=args.host,
    )
    signal.signal(signal.SIGTERM, _interrupt)  # SIGINT already raises KeyboardInterrupt
    engine = LoopbackEngine(spec, args.model)
    try:
        engine.start().wait_ready()
        ready = {"url": engine.url, "bootstrap_url": engine.bootstrap_url, "ranks": spec.tp}
        print(json.dumps(ready), flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        engine.stop()
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

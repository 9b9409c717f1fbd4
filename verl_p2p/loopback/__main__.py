"""`verl-p2p serve-loopback --model PATH --tp 2 --ep 2 --port P --bootstrap-port B`: serve one loopback engine.

Prints one JSON line (`url`, `bootstrap_url`, `ranks`) once every rank published its weights, then serves
until SIGINT or SIGTERM and stops every rank process. `python -m verl_p2p.loopback serve ...` is the same
command; the engine (FastAPI, SGLang) is imported only once the options parsed, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from verl_p2p.cli.help import HelpFormatter
from verl_p2p.cli.help import parser as command_parser

PROG = "verl-p2p serve-loopback"
SUMMARY = (
    "Serve one loopback engine (SGLang's model classes on CPU) until SIGINT or SIGTERM; one JSON line (url, "
    "bootstrap_url, ranks) says it is ready."
)


def add_serve_options(serve: argparse.ArgumentParser) -> None:
    """The options of one served engine (both spellings of the command take the same)."""
    serve.add_argument("--model", required=True, help="HF checkpoint directory to load (required)")
    serve.add_argument("--tp", type=int, default=1, help="tensor-parallel size: rank processes of the engine")
    serve.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides --tp)")
    serve.add_argument("--dp-attention", type=int, default=1, help="DP-attention size (divides --tp; 1: off)")
    serve.add_argument("--dtype", default="float32", help="dtype the ranks load the weights in")
    serve.add_argument("--host", default="127.0.0.1", help="address the control plane and bootstrap bind to")
    serve.add_argument("--port", type=int, default=None, help="control plane port (default: a free port)")
    serve.add_argument("--bootstrap-port", type=int, default=None, help="bootstrap server port (default: a free port)")
    serve.add_argument(
        "--api-key", default=None, help="key the control plane requires, as SGLang's --api-key (default: none)"
    )
    serve.add_argument("--sglang-version", default=None, help="SGLang release to imitate (default: the installed one)")


def serve_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """`verl-p2p serve-loopback`'s parser."""
    parser = command_parser(prog, SUMMARY)
    add_serve_options(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """`python -m verl_p2p.loopback serve ...`: the same options under the `serve` sub-command."""
    parser = argparse.ArgumentParser(prog="python -m verl_p2p.loopback", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="serve one loopback engine until SIGINT/SIGTERM", formatter_class=HelpFormatter
    )
    add_serve_options(serve)
    return parser


def serve_main(argv: list[str] | None = None) -> int:
    """`verl-p2p serve-loopback`."""
    return serve(serve_parser().parse_args(argv))


def serve(args: argparse.Namespace) -> int:
    from verl_p2p.loopback.engine import EngineSpec, LoopbackEngine

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

"""`verl-p2p demo`: the main job on the built-in default, no GPU.

Two loopback rollout engines (tiny Qwen3-MoE, one TP2/EP2 and one TP2/EP1, SGLang's real model classes loaded
by SGLang's loader) and one trainer source whose weights are a tiny Megatron model built through Megatron-Bridge
on CPU. Every step runs the full sync lifecycle (abort, release KV, begin, connect once, push over real Mooncake
tcp writes, bump version, end, resume KV, resume) and checks the result bit for bit:

- step 0 pushes the trainer's initial weights with `check_weight_update_equal` on: every rank snapshots and
  randomises its tensors before the sync and must compare equal after it (the rollout's own load is the witness);
- steps 1.. scale every trainer parameter by (1 + step/8). A scale commutes with every slicing, fusing and
  transposing a layout does, and zero padding stays zero, so each rank must then hold exactly its bytes from
  SGLang's own load, scaled the same way: an independent expectation that never goes through the replica.
Quiet by default: third-party warnings, logs and child processes' output go to a log file whose path is
printed (`-v` shows them). Exits 1 on any mismatch. `--corrupt-after-step N` (hidden, for the negative-control
test) flips one byte of one rank right after step N's sync, so that step's check must report it and the run
must exit 1. torch, SGLang and Megatron are imported once the options parsed (`--help` answers at once).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_p2p.cli.help import parser as command_parser
from verl_p2p.cli.quiet import progress, run_quietly

if TYPE_CHECKING:
    import torch

ENGINES = (("TP2/EP2", 2, 2), ("TP2/EP1", 2, 1))


def _scale(step: int) -> float:
    return 1.0 + step / 8.0


def trainer_engine(model_dir: Path, parallel: Any = None) -> Any:
    """verl's real MegatronEngine class holding a Megatron-Bridge model of `model_dir` (default: a world of one,
    gloo; with `parallel`, this rank's part of an already initialised process group)."""
    import torch

    from verl_p2p.sandbox.cpu_megatron import free_port, init_distributed, megatron_engine_shell

    if not torch.distributed.is_initialized():
        init_distributed(0, 1, free_port())
    return megatron_engine_shell(model_dir, parallel)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _verify(engines: list, witness: list[dict[int, dict[str, torch.Tensor]]], scale: float) -> list[str]:
    """Mismatches of every rank of every engine against its own initial load scaled by `scale`."""
    problems = []
    for index, engine in enumerate(engines):
        for rank, initial in witness[index].items():
            held = engine.dump(rank)
            if sorted(held) != sorted(initial):
                problems.append(f"engine {index} rank {rank}: parameter set changed")
                continue
            for name, tensor in initial.items():
                if not _bitwise_equal(held[name], tensor * scale):
                    problems.append(f"engine {index} rank {rank}: {name} differs")
    return problems


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


async def _run(args: argparse.Namespace, workdir: Path) -> int:
    import torch

    from verl_p2p.backend.topology import sole_source_assignment
    from verl_p2p.config import P2PConfig
    from verl_p2p.loopback.engine import EngineSpec, LoopbackEngine
    from verl_p2p.rollout.adapter import P2PReplicaAdapter
    from verl_p2p.rollout.lifecycle import SyncLifecycle
    from verl_p2p.sandbox.tiny import write_tiny_checkpoint
    from verl_p2p.trainer.source import SourceSession

    t0 = time.perf_counter()
    model_dir = write_tiny_checkpoint(workdir / "qwen3_moe", "qwen3_moe", id_encoded=False, seed=args.seed)
    engines = [LoopbackEngine(EngineSpec(tp=tp, ep=ep, dtype="float32"), str(model_dir)) for _, tp, ep in ENGINES]
    names = [f"engine {i} ({label})" for i, (label, _, _) in enumerate(ENGINES)]
    print(
        f"[demo] starting {len(engines)} loopback rollout engines ({sum(tp for _, tp, _ in ENGINES)} SGLang rank "
        "processes, tiny Qwen3-MoE) and a Megatron-Bridge trainer, all on CPU"
    )
    try:
        with progress("[demo]", ["trainer", *names]) as started:
            for engine in engines:  # rank processes start now, while the trainer model builds
                engine.start()
            trainer = trainer_engine(model_dir)
            started.done("trainer")
            initial = {name: p.detach().clone() for c in trainer.module for name, p in c.named_parameters()}
            for name, engine in zip(names, engines, strict=True):
                engine.wait_ready()
                started.done(name)
        witness = [{r: e.dump(r) for r in range(e.spec.tp)} for e in engines]
        print(f"[demo] ready in {time.perf_counter() - t0:.1f}s: tiny Qwen3-MoE at {model_dir}")
        for (label, _, _), e in zip(ENGINES, engines, strict=True):
            print(f"[demo]   engine {engines.index(e)} {label}: {e.url} (bootstrap {e.bootstrap_url})")

        config = P2PConfig(
            protocol="tcp",
            hostname="127.0.0.1",
            check_weight_update_equal=True,
            bucket_size_mb=args.bucket_mb,
            p2p_transfer_timeout=30.0,
            http_timeout=30.0,
        )
        adapters = [
            P2PReplicaAdapter(i, e.url, bootstrap_url=e.bootstrap_url, config=config) for i, e in enumerate(engines)
        ]
        lifecycle = SyncLifecycle(adapters, config, frees_kv=True)
        source = SourceSession(config, trainer, hostname="127.0.0.1")
        held_key = [None]

        async def prepare(connection: Any) -> None:  # before the pause: plan, replicas, programs, slots
            sessionless = lifecycle.sessionless_engines()
            if held_key[0] != (connection.generation, sessionless):
                plan = sole_source_assignment(connection, sessionless)
                await asyncio.to_thread(source.apply, plan)
                held_key[0] = (connection.generation, sessionless)
                print(
                    f"[demo] plan generation {plan.generation}: trainer rank 0 (pp 0) -> "
                    + ", ".join(str(t) for t in plan.targets)
                )

        async def push(connection: Any) -> dict:
            await prepare(connection)  # a re-push's partial plan
            metrics = await asyncio.to_thread(source.push)
            per_target = {str(t): n for t, n in metrics.bytes_per_target.items()}
            return {"metrics": metrics, "per_target": per_target}

        rows, failed, syncing = [], False, 0.0
        for step in range(args.steps):
            scale = _scale(step)
            with torch.no_grad():
                for chunk in trainer.module:
                    for name, param in chunk.named_parameters():
                        param.copy_(initial[name] * scale)
            report = await lifecycle.sync(step, push, prepare=prepare)
            metrics = report.metrics["metrics"]
            if step == args.corrupt_after_step:  # negative control: the check below must catch this byte
                name = sorted(witness[0][0])[0]
                engines[0].flip_byte(0, name, 0)
                print(f"[demo] negative control: flipped byte 0 of {name} on engine 0 rank 0 after step {step}'s sync")
            problems = _verify(engines, witness, scale)
            failed |= bool(problems)
            for problem in problems[:10]:
                print(f"[demo] MISMATCH step {step}: {problem}")
            if step == 0:
                print(
                    "[demo] bytes per target: "
                    + ", ".join(f"{t}: {n / 1e6:.2f} MB" for t, n in report.metrics["per_target"].items())
                )
            phases = report.phases
            syncing += phases.get("total", 0.0)
            rows.append(
                [
                    step,
                    f"x{scale:.3f}",
                    "yes" if report.reconnected else "no",
                    f"{phases.get('total', 0):.3f}",
                    f"{phases.get('control_plane', 0):.3f}",
                    f"{phases.get('push', 0):.3f}",
                    f"{metrics.total_bytes / 1e6:.2f}",
                    f"{metrics.gbps:.3f}",
                    "bit-exact" if not problems else f"{len(problems)} MISMATCHES",
                ]
            )
        print(
            "\n"
            + _table(
                rows,
                [
                    "step",
                    "weights",
                    "connect",
                    "total s",
                    "control s",
                    "push s",
                    "MB",
                    "GB/s",
                    "every rank of every engine",
                ],
            )
        )
        if args.verbose:
            print("\nphases of the last sync (s):\n" + lifecycle_phase_table(report.phases))
        print(
            f"\n[demo] {'FAILED' if failed else 'OK'}: {sync_summary(args.steps, syncing, time.perf_counter() - t0)}"
            + (" (step 0 also passed the rollout's weights_checker compare)" if not failed else "")
        )
        source.close()
        lifecycle.close()
        return 1 if failed else 0
    finally:
        for engine in engines:
            engine.stop()


def sync_summary(steps: int, syncing_s: float, elapsed_s: float) -> str:
    """The syncs' own time (each lifecycle's total, the table's column) apart from the run's, which is mostly
    starting the engines and the trainer: a reader comparing sync times needs the first."""
    return f"{steps} syncs, {syncing_s:.2f} s syncing ({elapsed_s:.1f} s with start-up)"


def lifecycle_phase_table(phases: dict[str, float]) -> str:
    return _table([[k, f"{v:.4f}"] for k, v in phases.items()], ["phase", "seconds"])


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("verl-p2p demo", __doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=4, help="syncs to run: step 0 (weights_checker compare) plus scaled steps"
    )
    parser.add_argument(
        "--bucket-mb", type=int, default=1, help="transfer slot size in MiB (small: exercises chunking)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny Qwen3-MoE checkpoint's weights")
    parser.add_argument("-v", "--verbose", action="store_true", help="show third-party output instead of logging it")
    parser.add_argument("--corrupt-after-step", type=int, default=None, help=argparse.SUPPRESS)  # see the docstring
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_quietly("demo", args.verbose, lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()
    with tempfile.TemporaryDirectory(prefix="verl-p2p-demo-") as tmp:
        return asyncio.run(_run(args, Path(tmp)))  # a failure: run_quietly's one line, or (-v) the traceback


if __name__ == "__main__":
    sys.exit(main())

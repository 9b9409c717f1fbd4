"""Trainer ranks in a real gloo world, each serving its driver's calls in order as a Ray actor does
(tests/test_stalled_rank_export.py): one rank SIGKILLs or SIGSTOPs itself inside its export stream.

Real: torch.distributed (gloo), the trainer's own groups with the timeout a trainer configures (the world and
Megatron's parallel_state groups, `distributed_timeout_minutes`; FSDP2's mesh is the world), the model (a
Megatron-Bridge TP2 x DP2 model, or an HF model under FSDP2 `fully_shard` streamed by verl's own engine method),
p2p's `SourceSession` (apply, go/no-go over p2p's bounded groups, the export, Mooncake tcp writes), the signals,
and each rank's `SourceMeta.export_peers` as `verl_engine.export_peers` reads it from the engine. Stand-ins: those
named in `verl_p2p.sandbox.cpu_megatron` and `tests/support/fsdp_ranks.py`.

A rank reports `("meta", SourceMeta)` once built, then per call `(rank, name, outcome, seconds, bytes)`:
outcome "ok", "skipped" (its assignment leaves it out of the export) or "ErrorType: message"; seconds: the push.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

TP = 2  # Megatron: TP2 x DP2 on four ranks


@dataclass(frozen=True)
class Trainer:
    kind: str  # "megatron" (TP2 x DP2 unless `tp`/`pp` say otherwise, PP-local export) or "fsdp" (FSDP2, full stream)
    world: int
    port: int
    model_dir: str
    deadline_s: float  # p2p_push_deadline_s (p2p's own go/no-go groups)
    group_timeout_s: float  # the trainer's own groups: the export's gathers run on them
    tp: int = TP  # Megatron's tensor- and pipeline-parallel sizes (data parallel: the rest of the world)
    pp: int = 1


@dataclass(frozen=True)
class Call:
    name: str
    assignment: Any
    fault: tuple[int, int] | None = None  # (signal, tensors streamed before this rank sends it to itself)


def serve(rank: int, trainer: Trainer, inbox: Any, out: Any) -> None:
    """Child entry: build the rank, report its SourceMeta, run each Call from `inbox` until None."""
    try:
        session, meta = _build(rank, trainer)
        out.put(("meta", rank, meta))
        while (call := inbox.get()) is not None:
            out.put(_run(rank, session, call))
        session.close()
    except BaseException:  # noqa: BLE001 - reported to the test verbatim
        out.put(("error", rank, traceback.format_exc()))


def init_rank(rank: int, trainer: Trainer) -> tuple[Any, Any]:
    """Join the gloo world as `rank` and build its model: (the owner p2p's source reads it through, the engine)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    import torch

    from verl_p2p.sandbox.cpu_megatron import init_distributed
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    torch.set_num_threads(1)
    install_cpu_stubs()
    init_distributed(rank, trainer.world, trainer.port, timeout_s=trainer.group_timeout_s)
    if trainer.kind == "megatron":
        from verl_p2p.sandbox.cpu_megatron import Parallel, megatron_engine_shell

        parallel = Parallel(tp=trainer.tp, pp=trainer.pp)
        engine = megatron_engine_shell(trainer.model_dir, parallel, timeout_s=trainer.group_timeout_s)
        return engine, engine
    from support.fsdp_ranks import actor_worker, cpu_platform_for_verl_fsdp, fsdp2_engine

    cpu_platform_for_verl_fsdp()
    engine = fsdp2_engine(trainer.model_dir, trainer.world)
    return actor_worker(engine), engine


def p2p_options(trainer: Trainer) -> dict[str, Any]:
    """The p2p options of every rank (`engine_kwargs.p2p`): tcp on 127.0.0.1, p2p's deadline from `trainer`."""
    return {
        "protocol": "tcp",
        "hostname": "127.0.0.1",
        "bucket_size_mb": 1,
        "p2p_transfer_timeout": trainer.deadline_s / 2,
        "p2p_push_deadline_s": trainer.deadline_s,
        "plan_cache_dir": "",
    }


@contextmanager
def signalled_in_stream(session: Any, fault: tuple[int, int] | None) -> Iterator[None]:
    """While inside: `session`'s export stream sends this process `fault[0]` after `fault[1]` tensors (SIGSTOP:
    it resumes there on SIGCONT). None: no fault."""
    if fault is None:
        yield
        return
    sig, after = fault
    original = session.stream

    def faulting(*args: Any, **kwargs: Any):
        for i, item in enumerate(original(*args, **kwargs)):
            if i == after:
                os.kill(os.getpid(), signal.Signals(sig))
            yield item

    session.stream = faulting
    try:
        yield
    finally:
        del session.stream


def _build(rank: int, trainer: Trainer) -> tuple[Any, Any]:
    from verl_p2p.backend.topology import SourceMeta
    from verl_p2p.config import P2PConfig
    from verl_p2p.trainer.source import SourceSession
    from verl_p2p.trainer.verl_engine import export_peers

    owner, engine = init_rank(rank, trainer)
    session = SourceSession(P2PConfig(**p2p_options(trainer)), owner, hostname="127.0.0.1")
    full = trainer.kind == "fsdp"
    return session, SourceMeta(rank, 0, 1, 0, full_stream=full, export_peers=export_peers(engine))


def _run(rank: int, session: Any, call: Call) -> tuple:
    session.apply(call.assignment)
    with signalled_in_stream(session, call.fault):
        t0 = time.monotonic()
        try:
            if not call.assignment.export:
                session.push()
                return ("call", rank, call.name, "skipped", time.monotonic() - t0, {})
            metrics = session.push()
            written = {} if metrics is None else {(t.engine, t.rank): n for t, n in metrics.bytes_per_target.items()}
            return ("call", rank, call.name, "ok", time.monotonic() - t0, written)
        except Exception as exc:  # noqa: BLE001 - reported
            return ("call", rank, call.name, f"{type(exc).__name__}: {exc}", time.monotonic() - t0, {})

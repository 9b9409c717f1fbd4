"""The trainer side of the e2e harness, in a process of its own (so a drill can SIGKILL it mid-push).

The process holds a Megatron-Bridge model of the checkpoint (on the GPU with `device="cuda"`) inside verl's real
MegatronEngine class, and the real `SourceSession` over it: `apply` takes a plan generation, `push` exports the
model and writes it to the targets, `weights` sets the model to a numbered weight set (set k = the checkpoint's
weights times `weight_scale(k)`), `save` writes a weight set as an HF checkpoint (what a fresh rollout starts from).
The parent talks to it over a pipe: one command at a time, each answered ("ok", value) or ("error", traceback).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_p2p import pipe
from verl_p2p.errors import P2PError


def weight_scale(weights: int) -> float:
    """Weight set k is the checkpoint scaled by 1 + k/8: a scale changes every output, keeps zeros zero, and is
    exactly reproducible in bf16 from the same starting values."""
    return 1.0 + weights / 8.0


@dataclass(frozen=True)
class TrainerSpec:
    """What the trainer process is built from."""

    model_dir: str
    device: str = "cpu"  # "cuda": Megatron model, export and transfer slots on the GPU
    dtype: str = "float32"  # Megatron parameter dtype (bfloat16 for bf16 checkpoints)
    hostname: str = "127.0.0.1"  # the address rollout ranks reach this process's Mooncake endpoint at
    config: dict[str, Any] = field(default_factory=dict)  # P2PConfig fields


class TrainerDied(P2PError):
    """The trainer process exited (or was killed) before answering."""


def _serve(spec: TrainerSpec, conn: Any) -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    import torch

    from verl_p2p.config import P2PConfig
    from verl_p2p.sandbox.cpu_megatron import free_port, init_distributed, megatron_engine_shell
    from verl_p2p.trainer.source import SourceSession

    cuda = spec.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    else:
        from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

        install_cpu_stubs()
    init_distributed(0, 1, free_port(), backend="nccl" if cuda else "gloo")
    engine = megatron_engine_shell(spec.model_dir, device=spec.device, dtype=getattr(torch, spec.dtype))
    params = {name: p for chunk in engine.module for name, p in chunk.named_parameters()}
    initial = {name: p.detach().clone() for name, p in params.items()}
    source = SourceSession(P2PConfig(**spec.config), engine, hostname=spec.hostname)

    def set_weights(k: int) -> None:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(initial[name] * weight_scale(k))

    def save(k: int, path: str) -> str:
        from safetensors.torch import save_file

        set_weights(k)
        exported = engine.bridge.export_hf_weights(
            engine.module, cpu=True, show_progress=False, merge_adapter_weights=False
        )
        tensors = {name: tensor.contiguous().clone() for name, tensor in exported}
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        for extra in ("config.json", "generation_config.json"):
            if (Path(spec.model_dir) / extra).exists():
                shutil.copy(Path(spec.model_dir) / extra, out / extra)
        return str(out)

    recorded: list[list[Any]] = []  # the last push's write lists (what a raw replay moves again)

    def raw_replay() -> float | None:
        """The last push's write lists again, raw (no export, replica or staging), timed; None without one."""
        from verl_p2p.transfer.replay import raw_replay as replay

        if not recorded or source.writer is None or source.buffers is None:
            return None
        seconds = replay(source.writer, recorded, [(x.addr, x.addr + x.nbytes) for x in source.buffers.slots])
        if cuda:
            torch.cuda.synchronize()
        return seconds

    def push(options: dict[str, Any]) -> dict[str, Any]:
        raw_s = raw_replay() if options.get("raw") else None  # the push below rewrites every byte it wrote
        if source.writer is not None:  # record this push's write lists
            recorded.clear()
            submit_recorded = source.writer.submit

            def recording_submit(entries):
                entries = list(entries)
                recorded.append(entries)
                return submit_recorded(entries)

            source.writer.submit = recording_submit
        stall_after = options.get("stall_after_batches")
        if stall_after is not None:  # drill: stop for good in the middle of batch `stall_after`
            submit, submitted = source.writer.submit, [0]

            def stalling_submit(entries):
                entries = list(entries)
                submitted[0] += 1
                if submitted[0] < stall_after:
                    return submit(entries)
                # only the first half of this batch goes out (and lands): a small model's push is one batch, so
                # stopping after a whole batch would leave nothing unwritten and the kill would not be mid-push
                submit(entries[: max(1, len(entries) // 2)]).wait()
                Path(options["stall_marker"]).touch()
                time.sleep(3600)  # the parent SIGKILLs this process here, mid-push

            source.writer.submit = stalling_submit
        try:
            metrics = source.push()
        finally:
            if source.writer is not None:
                source.writer.__dict__.pop("submit", None)  # the class's submit again
        if cuda:
            torch.cuda.synchronize()
        if metrics is None:
            return {}
        extra = {}
        if raw_s is not None:
            extra = {
                "raw_seconds": raw_s,
                "push_over_raw": metrics.seconds_total / raw_s,
                "push_over_raw_less_export": (metrics.seconds_total - metrics.seconds_hf_wait) / raw_s,
            }
        return {
            **extra,
            "bytes": metrics.total_bytes,
            "seconds": metrics.seconds_total,
            "gbps": metrics.gbps,
            "seconds_load": metrics.seconds_load,
            "seconds_write_wait": metrics.seconds_write_wait,
            "seconds_hf_wait": metrics.seconds_hf_wait,
            "per_target": {str(t): n for t, n in metrics.bytes_per_target.items()},
            "slots": f"{source.buffers.device.type}{' pinned' if source.buffers.pinned else ''}",
        }

    commands = {
        "weights": set_weights,
        "apply": source.apply,
        "push": push,
        "save": lambda arg: save(*arg),
        "pid": lambda _: os.getpid(),
    }
    pipe.send(conn, ("ok", {"pid": os.getpid(), "params": len(params)}))
    while True:
        try:
            command, arg = conn.recv()
        except EOFError:
            break
        if command == "stop":
            pipe.send(conn, ("ok", None))
            break
        try:
            value = commands[command](arg)
            pipe.send(conn, ("ok", value))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent verbatim
            pipe.send(conn, ("error", _failure(exc)))
    source.close()


def _failure(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}


def _main(spec: TrainerSpec, conn: Any) -> None:
    try:
        _serve(spec, conn)
    except BaseException as exc:  # noqa: BLE001 - a failed start is reported to the parent
        try:
            pipe.send(conn, ("error", _failure(exc)))
        except OSError:
            pass
        raise


class TrainerProcess:
    """Parent-side handle of the trainer process."""

    def __init__(self, spec: TrainerSpec):
        self.spec = spec
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_main, args=(spec, child), name="e2e-trainer", daemon=True)
        self._proc.start()
        child.close()
        self.started = time.perf_counter()
        self.tracebacks: list[str] = []  # of failed commands, newest last
        self._closed = False

    def wait_ready(self, timeout_s: float = 600) -> dict:
        return self._answer("start", timeout_s)

    def call(self, command: str, arg: Any = None, timeout_s: float = 600) -> Any:
        try:
            pipe.send(self._conn, (command, arg))
        except OSError as exc:  # the pipe's other end is gone
            raise TrainerDied(f"trainer process exited (code {self._proc.exitcode}) before {command!r}") from exc
        return self._answer(command, timeout_s)

    def _answer(self, command: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.1):
            if not self._proc.is_alive():
                raise TrainerDied(f"trainer process exited (code {self._proc.exitcode}) during {command!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer process did not answer {command!r} within {timeout_s:g} s")
        try:
            status, value = self._conn.recv()
        except EOFError as exc:
            raise TrainerDied(f"trainer process exited (code {self._proc.exitcode}) during {command!r}") from exc
        if status != "ok":
            self.tracebacks.append(value["traceback"])
            raise P2PError(f"trainer command {command!r} failed: {value['type']}: {value['message']}")
        return value

    @property
    def pid(self) -> int | None:
        return None if self._closed else self._proc.pid

    def kill(self) -> None:
        """SIGKILL, as a crashed or preempted trainer node would go."""
        self._proc.kill()
        self._proc.join(timeout=10)

    def stop(self) -> None:
        if self._closed:
            return
        if self._proc.is_alive():
            try:
                pipe.send(self._conn, ("stop", None))
                self._proc.join(timeout=30)
            except OSError:
                pass
        if self._proc.is_alive():
            self.kill()
        self._conn.close()  # the pipe and the process sentinel: a replaced trainer leaves no fd behind
        if not self._proc.is_alive():
            self._proc.close()
            self._closed = True

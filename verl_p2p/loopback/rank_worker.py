"""One loopback rank: a spawned process holding SGLang's model for TP rank r, and the parent's handle to it.

The process builds its model through SGLang's own distributed path (`build_sglang_rank_model`, a real gloo
group), registers every parameter's memory with a Mooncake TransferEngine, publishes
`(session_id, weights_info)` to the engine's bootstrap server like SGLang's ModelRunner does, then serves
requests from the parent over a pipe: dump, weights_digest, flip_byte, weights_checker actions, post-load
processing.
It exits when the parent dies (pipe EOF or a changed parent pid): no orphans.
"""

from __future__ import annotations

import importlib
import io
import itertools
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from verl_p2p import pipe

DEFAULT_BUILDER = "verl_p2p.loopback.sglang_rank:build_sglang_rank_model"
# imported once by the template the engine's ranks are forked from (sandbox/forked.py)
RANK_PRELOAD = ["verl_p2p.loopback.rank_preload"]


class RankUnavailable(RuntimeError):
    """A rank process is dead, or frozen / busy past the timeout."""


class RankOpError(RuntimeError):
    """A rank answered, but the requested operation raised (bad parameter name, byte index, ...)."""


@dataclass(frozen=True)
class RankArgs:
    """Everything a rank process needs (pickled into the spawned process)."""

    rank: int
    tp_size: int
    model_path: str
    server_args: dict
    dist_init_method: str
    bootstrap_url: str
    host: str = "127.0.0.1"
    builder: str = DEFAULT_BUILDER


# ----------------------------------------------------------------------------------------------- rank side


def _watch_parent(parent_pid: int) -> None:
    """Exit when the engine process is gone. A rank forked from a template is the template's child, and the
    template exits with the engine: either way the rank's parent changes when the engine dies."""
    start_parent = os.getppid()
    while True:
        if os.getppid() != start_parent or not _alive(parent_pid):
            os._exit(0)
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or its number now someone else's process's
        return False
    return True


def _load_builder(path: str):
    module, _, func = path.partition(":")
    return getattr(importlib.import_module(module), func)


def _register_weights(model, engine) -> dict[str, list[int]]:
    """Register every parameter's memory; the weights info SGLang publishes: {name: [addr, numel, elem size]}."""
    info: dict[str, list[int]] = {}
    registered: set[int] = set()
    for name, param in model.named_parameters():
        if param.device.type != "cpu" or not param.is_contiguous():
            raise RuntimeError(f"parameter {name} is not contiguous CPU memory ({param.device}, {param.stride()})")
        ptr, nbytes = param.data_ptr(), param.numel() * param.element_size()
        if ptr not in registered and nbytes > 0:
            ret = engine.register_memory(ptr, nbytes)
            if ret != 0:
                raise RuntimeError(f"Mooncake register_memory failed for {name}: {ret}")
            registered.add(ptr)
        info[name] = [ptr, param.numel(), param.element_size()]
    return info


def _publish(bootstrap_url: str, rank: int, session_id: str, weights_info: dict, timeout: float = 300.0) -> None:
    """PUT the rank's info to the bootstrap server, in the body SGLang's ModelRunner sends (retried until it is up)."""
    import requests

    body = {"tp_rank": rank, "transfer_engine_info": {"session_id": session_id, "weights_info_dict": weights_info}}
    deadline = time.monotonic() + timeout
    while True:
        try:
            resp = requests.put(f"{bootstrap_url}/register_transfer_engine_info", json=body, timeout=10)
            break
        except requests.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    if resp.status_code != 200:
        raise RuntimeError(f"bootstrap registration of rank {rank} failed: {resp.status_code} {resp.text}")


class _RankServer:
    """The request handlers of one rank process."""

    def __init__(self, model, args: RankArgs):
        from verl_p2p.loopback.checker import Placement, WeightChecker

        self.model = model
        self.params = dict(model.named_parameters())
        sa = args.server_args
        attn_dp = int(sa.get("dp_size") or 1) if sa.get("enable_dp_attention") else 1
        attn_tp = args.tp_size // attn_dp
        placement = Placement(args.rank, args.tp_size, dp_rank=args.rank // attn_tp, dp_size=attn_dp)
        self.checker = WeightChecker(model, placement)

    def ping(self) -> int:
        return os.getpid()

    def dump(self) -> bytes:
        import torch

        buf = io.BytesIO()
        torch.save({name: p.detach().clone() for name, p in self.params.items()}, buf)
        return buf.getvalue()

    def weights_digest(self) -> str:
        """A digest of every parameter's bytes: equal digests, equal weights (the prefix-cache tracking)."""
        import hashlib

        import torch

        h = hashlib.blake2b(digest_size=16)
        for name in sorted(self.params):
            h.update(name.encode())
            h.update(self.params[name].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def flip_byte(self, name: str, index: int) -> tuple[int, int]:
        import torch

        if name not in self.params:
            raise KeyError(f"no parameter {name!r} on this rank")
        raw = self.params[name].data.view(-1).view(torch.uint8)
        if not 0 <= index < raw.numel():
            raise IndexError(f"byte index {index} outside {name} ({raw.numel()} bytes)")
        old = int(raw[index])
        raw[index] = old ^ 0xFF
        return old, int(raw[index])

    def check(self, action: str, skip_tensor_list=(), drop_snapshot_after_compare=False) -> dict:
        """A weights_checker action: {"success", "message", "payload"} (a failed check is an answer, not an error)."""
        from verl_p2p.loopback.checker import CheckFailed

        try:
            payload = self.checker.handle(action, tuple(skip_tensor_list or ()), drop_snapshot_after_compare)
        except CheckFailed as e:
            return {"success": False, "message": str(e), "payload": None}
        return {"success": True, "message": "Success.", "payload": payload}

    def dump_derived(self) -> bytes:
        """Copies of the non-parameter tensors the model derived after loading (MLA's w_kc / w_vc, attributes;
        GemmaRMSNorm's gemma_weight, a registered buffer): what `weights_checker` cannot see and a session end
        must rebuild."""
        import torch

        derived = {
            f"{module_name}.{attr}" if module_name else attr: t.detach().clone()
            for module_name, module in self.model.named_modules()
            for attr, t in {**module._buffers, **vars(module)}.items()
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
        }
        buf = io.BytesIO()
        torch.save(derived, buf)
        return buf.getvalue()

    def begin_update(self) -> bool:
        """What SGLang's begin_weight_update runs on a model runner: every quant method's
        `restore_weights_before_loading` (undo in-place packing). True when the release has it."""
        import torch
        from sglang.srt.model_loader.loader import DefaultModelLoader

        restore = getattr(DefaultModelLoader, "restore_weights_before_loading", None)
        if restore is None:
            return False
        restore(self.model, torch.device("cpu"))
        return True

    def post_load(self) -> bool:
        """What SGLang's end_weight_update runs after bytes that bypassed its loader (p2p writes): the model's
        `post_load_weights` (MLA rebuilds w_kc / w_vc from kv_b_proj), then every quant method's
        `process_weights_after_loading`, through SGLang's own functions where the release has them (0.5.21
        on). True when the model has the hook."""
        import torch
        from sglang.srt.model_loader import loader

        has_hook = hasattr(self.model, "post_load_weights")
        run_hook = getattr(loader, "post_load_weights", None)
        if run_hook is not None:
            run_hook(self.model)
        elif has_hook:
            self.model.post_load_weights()
        postprocess = getattr(loader.DefaultModelLoader, "postprocess_weights", None)
        if postprocess is not None:
            postprocess(self.model, torch.device("cpu"))
        else:  # releases before it: the loop SGLang's loader runs after a load
            for module in self.model.modules():
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)
        return has_hook


def rank_main(args: RankArgs, conn: Connection, parent_pid: int) -> None:
    """Entry point of a rank process (forked from the engine's preloaded template)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which stops the ranks
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

        install_cpu_stubs()
        model = _load_builder(args.builder)(
            args.model_path, args.server_args, args.rank, args.tp_size, args.dist_init_method
        )
        from mooncake.engine import TransferEngine

        engine = TransferEngine()  # lives until the process exits: its registrations must stay valid
        if engine.initialize(args.host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake TransferEngine.initialize failed")
        session_id = f"{args.host}:{engine.get_rpc_port()}"
        weights_info = _register_weights(model, engine)
        _publish(args.bootstrap_url, args.rank, session_id, weights_info)
        server = _RankServer(model, args)
    except BaseException:
        pipe.send(conn, ("failed", traceback.format_exc()))
        raise SystemExit(1) from None
    pipe.send(conn, ("ready", {"session_id": session_id, "pid": os.getpid(), "num_params": len(weights_info)}))
    while True:
        try:
            req_id, op, kwargs = conn.recv()
        except (EOFError, OSError):
            break
        if op == "shutdown":
            break
        try:
            reply: tuple = (req_id, True, getattr(server, op)(**kwargs))
        except Exception as e:  # answered to the parent, never fatal to the rank
            reply = (req_id, False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        pipe.send(conn, reply)
    # Nothing to save: skip interpreter teardown (gloo, Mooncake threads), which takes seconds.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------- parent side


class RankHandle:
    """The parent's end of one rank process: requests with timeouts, signals, liveness."""

    def __init__(self, rank: int, process, conn: Connection):
        self.rank = rank
        self.process = process
        self._conn = conn
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.session_id: str | None = None
        self.frozen = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def death_reason(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "running"
        return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def wait_ready(self, deadline: float) -> dict:
        """Block until the rank published its info; raises RankUnavailable with the rank's traceback."""
        while time.monotonic() < deadline:
            if self._conn.poll(0.2):
                try:
                    kind, payload = self._conn.recv()
                except EOFError:
                    break
                if kind == "ready":
                    self.session_id = payload["session_id"]
                    return payload
                raise RankUnavailable(f"rank {self.rank} failed to start:\n{payload}")
            if not self.alive():
                break
        if self.alive():
            raise RankUnavailable(f"rank {self.rank} did not start in time")
        raise RankUnavailable(f"rank {self.rank} died while starting ({self.death_reason()})")

    def call(self, op: str, timeout: float, **kwargs) -> Any:
        """One request. RankUnavailable: dead or silent past `timeout`; RankOpError: the operation raised."""
        with self._lock:
            if not self.alive():
                raise RankUnavailable(f"rank {self.rank} is dead ({self.death_reason()})")
            req_id = next(self._ids)
            try:
                pipe.send(self._conn, (req_id, op, kwargs))
            except OSError as e:
                raise RankUnavailable(f"rank {self.rank} is unreachable: {e}") from e
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    state = "frozen (SIGSTOP)" if self.frozen else "not answering"
                    raise RankUnavailable(f"rank {self.rank} is {state}: no answer to {op} in {timeout:.0f} s")
                if self._conn.poll(min(left, 0.2)):
                    try:
                        got_id, ok, payload = self._conn.recv()
                    except (EOFError, OSError) as e:
                        raise RankUnavailable(f"rank {self.rank} died during {op} ({self.death_reason()})") from e
                    if got_id != req_id:  # a late answer to a request that timed out earlier
                        continue
                    if not ok:
                        raise RankOpError(f"rank {self.rank}: {op} failed: {payload}")
                    return payload
                if not self.alive():
                    raise RankUnavailable(f"rank {self.rank} died during {op} ({self.death_reason()})")

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)
        if sig == signal.SIGSTOP:
            self.frozen = True
        elif sig == signal.SIGCONT:
            self.frozen = False

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL and reap (SIGKILL also ends a stopped process)."""
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(timeout)
        self.frozen = False

    def request_stop(self) -> None:
        """Ask the rank to exit, without waiting."""
        if self.process.is_alive() and not self.frozen:
            try:
                pipe.send(self._conn, (0, "shutdown", {}))
            except OSError:
                pass

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the rank to exit, wait up to `timeout`, then SIGKILL whatever is left."""
        self.request_stop()
        if not self.frozen:
            self.process.join(timeout)
        self.kill()
        self._conn.close()

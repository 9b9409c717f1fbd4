"""A stand-in rollout rank for tests and the bench: a process that holds weight memory the way an SGLang
rank does (one tensor per parameter, registered with its own Mooncake engine) and publishes
`(session_id, {name: [address, numel, element_size]})`. It is NOT a rollout: it only receives writes.

The child runs this file as a script (it imports torch and Mooncake only, never the verl_p2p package) and
speaks JSON lines: the spec on stdin, then commands (`dump`, `digest`, `fill`, `stop`); replies on stdout
carry a marker so Mooncake's own output cannot be mistaken for one. Memory is prefilled with 0xFF bytes
(NaN in every float dtype) so a byte nobody wrote is visible.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_MARK = "@@verl-p2p-receiver "
FILL_BYTE = 0xFF


@dataclass
class ReceiverProcess:
    """Parent-side handle of one receiver process."""

    name: str
    popen: subprocess.Popen
    session_id: str = ""
    weights_info: dict[str, list[int]] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _send(self, **command) -> None:
        self.popen.stdin.write(json.dumps(command) + "\n")
        self.popen.stdin.flush()

    def _reply(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.popen.stdout.readline()
            if not line:
                raise RuntimeError(f"receiver {self.name} (pid {self.pid}) exited with {self.popen.poll()}")
            if line.startswith(_MARK):
                reply = json.loads(line[len(_MARK) :])
                if "error" in reply:
                    raise RuntimeError(f"receiver {self.name}: {reply['error']}")
                return reply
        raise TimeoutError(f"receiver {self.name} (pid {self.pid}) did not answer within {timeout_s} s")

    def wait_ready(self, timeout_s: float = 120.0) -> ReceiverProcess:
        reply = self._reply(timeout_s)
        self.session_id, self.weights_info = reply["session_id"], reply["weights_info"]
        return self

    def remote_info(self):
        """What this receiver published, as the trainer side parses it."""
        from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo

        params = {n: RemoteParam(int(v[0]), int(v[1]), int(v[2])) for n, v in self.weights_info.items()}
        return RemoteRankInfo(self.session_id, params)

    def call(self, cmd: str, timeout_s: float = 120.0, **args) -> dict:
        self._send(cmd=cmd, **args)
        return self._reply(timeout_s)

    def dump(self, path: str) -> dict:
        """The receiver's memory, `{name: uint8 tensor}` (through a torch.save file at `path`)."""
        import torch

        self.call("dump", path=path)
        return torch.load(path, weights_only=True)

    def digest(self) -> dict[str, str]:
        return self.call("digest")["digest"]

    def fill(self) -> None:
        """Prefill every parameter with 0xFF again (reuse one receiver across tests)."""
        self.call("fill")

    def freeze(self, timeout_s: float = 10.0) -> None:
        """Stop the receiver and return once every one of its threads is stopped: a stop is only requested by the
        signal, and on a loaded host a thread mid-call could still answer a write sent right after it."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not self._all_threads_stopped():
            if time.monotonic() > deadline:
                raise TimeoutError(f"receiver {self.pid} did not stop within {timeout_s} s of SIGSTOP")
            time.sleep(0.005)

    def _all_threads_stopped(self) -> bool:
        """Every thread of the process in state T (stopped), read from /proc (Linux, where the receiver runs)."""
        tasks = f"/proc/{self.pid}/task"
        try:
            states = []
            for tid in os.listdir(tasks):
                with open(f"{tasks}/{tid}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:
            return False
        return bool(states) and all(state in ("T", "t") for state in states)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                self._send(cmd="stop")
            except (OSError, ValueError):
                pass
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self.popen.stdin, self.popen.stdout):
            try:
                stream.close()
            except OSError:
                pass


def spec_from_plan(params: Mapping) -> dict[str, tuple[int, str]]:
    """`{name: (numel, dtype name)}` of a replica plan's params (`ParamPlan`-like: nbytes, dtype)."""
    return {n: (int(p.nbytes) // p.dtype.itemsize, str(p.dtype).removeprefix("torch.")) for n, p in params.items()}


def start_receiver(
    name: str,
    params: Mapping[str, tuple[int, str]],
    hostname: str = "127.0.0.1",
    protocol: str = "tcp",
) -> ReceiverProcess:
    """Start a receiver holding `params` ({name: (numel, torch dtype name)}); call `wait_ready()` next."""
    env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"))
    popen = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    spec = {"params": {k: [int(v[0]), str(v[1])] for k, v in params.items()}, "hostname": hostname}
    spec["protocol"] = protocol
    handle = ReceiverProcess(name=name, popen=popen)
    handle._send(**spec)
    return handle


def start_receivers(
    specs: Mapping[str, Mapping[str, tuple[int, str]]], hostname: str = "127.0.0.1", protocol: str = "tcp"
) -> dict[str, ReceiverProcess]:
    """Start several receivers at once (their start-ups overlap) and wait until all published."""
    handles = {n: start_receiver(n, p, hostname, protocol) for n, p in specs.items()}
    try:
        for handle in handles.values():
            handle.wait_ready()
    except BaseException:
        stop_all(handles.values())
        raise
    return handles


def stop_all(handles: Iterable[ReceiverProcess]) -> None:
    """Stop receivers together (each engine takes a moment to shut down)."""
    handles = list(handles)
    for handle in handles:
        if handle.popen.poll() is None:
            try:
                os.kill(handle.pid, signal.SIGCONT)
                handle._send(cmd="stop")
            except (OSError, ValueError):
                pass
    for handle in handles:
        handle.stop()


# ----------------------------------------------------------------------------------------------- child side


def _answer(**reply) -> None:
    sys.stdout.write(_MARK + json.dumps(reply) + "\n")
    sys.stdout.flush()


def _child() -> None:
    import hashlib

    import torch
    from mooncake.engine import TransferEngine

    spec = json.loads(sys.stdin.readline())
    tensors = {name: torch.empty(int(numel), dtype=getattr(torch, dt)) for name, (numel, dt) in spec["params"].items()}
    for t in tensors.values():
        t.view(torch.uint8).fill_(FILL_BYTE)
    engine = TransferEngine()
    if engine.initialize(spec["hostname"], "P2PHANDSHAKE", spec["protocol"], "") != 0:
        _answer(error="TransferEngine.initialize failed")
        return
    live = [t for t in tensors.values() if t.numel()]
    if live and engine.batch_register_memory([t.data_ptr() for t in live], [t.nbytes for t in live]) != 0:
        _answer(error="batch_register_memory failed")
        return
    info = {name: [t.data_ptr(), t.numel(), t.element_size()] for name, t in tensors.items()}
    _answer(session_id=f"{spec['hostname']}:{engine.get_rpc_port()}", weights_info=info, pid=os.getpid())
    for line in sys.stdin:
        command = json.loads(line)
        cmd = command["cmd"]
        if cmd == "stop":
            os._exit(0)  # skip the engine's slow teardown: nothing to save
        if cmd == "dump":
            torch.save({n: t.view(torch.uint8).clone() for n, t in tensors.items()}, command["path"])
            _answer(ok=True)
        elif cmd == "digest":
            digest = {
                n: hashlib.blake2b(t.view(torch.uint8).numpy(), digest_size=16).hexdigest() for n, t in tensors.items()
            }
            _answer(digest=digest)
        elif cmd == "fill":
            for t in tensors.values():
                t.view(torch.uint8).fill_(FILL_BYTE)
            _answer(ok=True)
        else:
            _answer(error=f"unknown command {cmd!r}")


if __name__ == "__main__":
    # Run as a script, this file's folder heads sys.path; its `mooncake.py` would shadow the real package.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    _child()

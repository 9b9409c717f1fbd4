"""The rollouts the e2e harness syncs into and compares against: a real SGLang server, or a loopback engine.

Both are started from an HF checkpoint with the SGLang server args p2p requires, taken from the project's own
Hydra config (`conf/p2p/default.yaml`, per-replica bootstrap port as `rollout/launch.py` derives it), and answer
the same questions: where they listen, the checksums of the weights they hold, and (real SGLang only) a greedy
generation for fixed token ids. The loopback is the CPU stand-in: it does not generate.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from verl_p2p.errors import P2PError

CONF = Path(__file__).resolve().parents[2] / "conf" / "p2p" / "default.yaml"

# What the H200 image's SGLang 0.5.12 set runs with (FlashAttention-3 / FlashMLA are not part of it), and no
# tokenizer: requests carry token ids. A small KV pool: from 0.5.21 SGLang sizes it from the GPU memory still free
# after its weights load, and refuses to start when that fell below its share, which is what another server's pool
# allocated meanwhile does on a shared GPU (the e2e starts every server at once). The cap is also what a server
# holds for KV whatever its mem fraction, which `real_sizes.one_gpu_budget` counts on.
MAX_TOTAL_TOKENS = 65536
SGLANG_GPU_FLAGS = (
    "--max-total-tokens",
    str(MAX_TOTAL_TOKENS),
    "--skip-tokenizer-init",
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    "--grammar-backend",
    "none",
    "--random-seed",
    "0",
)


class RolloutStartError(P2PError):
    """A rollout did not become ready; the message carries the end of its log."""


def p2p_server_args(replica_rank: int, base_port: int) -> dict[str, Any]:
    """The SGLang server args of `conf/p2p/default.yaml` for replica `replica_rank`, validated by the product code."""
    from omegaconf import OmegaConf

    from verl_p2p.rollout.launch import BOOTSTRAP_PORT, replica_server_args

    conf = OmegaConf.to_container(OmegaConf.load(CONF), resolve=False)
    sglang = dict(conf["actor_rollout_ref"]["rollout"]["engine_kwargs"]["sglang"])
    sglang[BOOTSTRAP_PORT] = base_port  # several engines share this host: keep clear of SGLang's default
    return replica_server_args(sglang, replica_rank)  # raises naming any arg p2p cannot work with


def local_ip() -> str:
    """This host's outward address (what SGLang publishes in its Mooncake session ids), else 127.0.0.1."""
    for probe in (("10.254.254.254", 1), ("192.0.2.1", 1)):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(probe)  # no packet is sent: this only picks the interface
                address = s.getsockname()[0]
                if not address.startswith("0."):
                    return address
        except OSError:
            continue
    return "127.0.0.1"


def free_port() -> int:
    """A free port below 55536: SGLang derives its gRPC port as port + 10000 and rejects anything above 65535."""
    from verl_p2p.loopback.engine import free_port as below_grpc_limit

    return below_grpc_limit("127.0.0.1")


async def checksums_of(name: str, client: Any) -> dict[str, str]:
    """`weights_checker` action `checksum`: {"tp<rank>:<tensor>": checksum} over every rank of the rollout."""
    answer = await client.weights_checker("checksum")
    out = {}
    for rank in answer.get("ranks") or []:
        info = rank["parallelism_info"]  # one dict; from SGLang 0.5.21 a list, one entry per runner role
        tp = (info[0] if isinstance(info, list) else info)["tp_rank"]
        out.update({f"tp{tp}:{tensor}": value for tensor, value in rank["checksums"].items()})
    if not out:
        raise P2PError(f"{name}: weights_checker checksum returned no checksums: {answer}")
    return out


async def greedy_generate(client: Any, input_ids: list[int], max_new_tokens: int, timeout: float) -> list[int]:
    """`/generate` for token ids, greedy, exactly `max_new_tokens` new tokens: the output token ids."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    answer = (await client.request("POST", "/generate", body=body, timeout=timeout)).json()
    return list(answer["output_ids"])


class SGLangServer:
    """A real SGLang server process (`python -m sglang.launch_server`), one GPU, TP 1."""

    kind = "sglang"
    generates = True

    def __init__(
        self,
        name: str,
        model_dir: str | Path,
        log_path: str | Path,
        *,
        replica_rank: int = 0,
        base_bootstrap_port: int = 26789,
        mem_fraction: float,
        p2p_args: bool = True,
        extra_flags: tuple[str, ...] = (),
    ):
        self.name, self.model_dir, self.log_path = name, str(model_dir), Path(log_path)
        self.port = free_port()
        self.server_args = p2p_server_args(replica_rank, base_bootstrap_port) if p2p_args else {}
        self.bootstrap_port = self.server_args.get("engine_info_bootstrap_port", free_port())
        self.flags = [
            "--model-path",
            self.model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--mem-fraction-static",
            str(mem_fraction),
            "--engine-info-bootstrap-port",
            str(self.bootstrap_port),
            *SGLANG_GPU_FLAGS,
            *extra_flags,
        ]
        if self.server_args.get("remote_instance_weight_loader_start_seed_via_transfer_engine"):
            self.flags.append("--remote-instance-weight-loader-start-seed-via-transfer-engine")
        if self.server_args.get("enable_memory_saver"):
            self.flags.append("--enable-memory-saver")
        self._proc: subprocess.Popen | None = None
        self._log = None
        self.starts = 0  # server processes started so far: a request sent to an earlier one died with it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def bootstrap_url(self) -> str:
        return f"http://127.0.0.1:{self.bootstrap_port}"

    def start(self) -> SGLangServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a")  # noqa: SIM115 - kept open for the server's lifetime (and restarts)
        command = [sys.executable, "-m", "sglang.launch_server", *self.flags]
        self._log.write("$ " + " ".join(command) + "\n")
        self._log.flush()
        self._proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ)
        )
        self.started = time.perf_counter()
        self.starts += 1
        return self

    def wait_ready(self, timeout_s: float = 900) -> float:
        """Seconds from start until `/health_generate` answered 200."""
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RolloutStartError(f"{self.name}: SGLang exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health_generate", timeout=5).status_code == 200:
                    return time.perf_counter() - self.started
            except requests.RequestException:
                pass
            time.sleep(2)
        raise RolloutStartError(f"{self.name}: not healthy within {timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    async def generate(self, client: Any, input_ids: list[int], max_new_tokens: int, timeout: float) -> list[int]:
        return await greedy_generate(client, input_ids, max_new_tokens, timeout)

    async def checksums(self, client: Any) -> dict[str, str]:
        return await checksums_of(self.name, client)

    def process_ids(self) -> list[int]:
        """Every live process of the server (its own session: launcher, scheduler(s), detokenizer)."""
        if self._proc is None:
            return []
        return _session_pids(self._proc.pid)

    def scheduler_pids(self) -> list[int]:
        """The scheduler processes (they hold the weights and the Mooncake engine): `sglang::scheduler*`."""
        pids = self.process_ids()
        named = [p for p in pids if p != self._proc.pid and "scheduler" in _process_title(p)]
        return named or [p for p in pids if p != self._proc.pid]  # untitled: every child of the launcher

    def freeze(self) -> list[int]:
        """SIGSTOP the schedulers (the HTTP front end keeps accepting calls); the pids stopped."""
        pids = self.scheduler_pids()
        if not pids:
            raise P2PError(f"{self.name}: no scheduler process found among {self.process_ids()}")
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    def thaw(self) -> None:
        for pid in self.process_ids():
            os.kill(pid, signal.SIGCONT)

    def restart(self) -> float:
        """SIGKILL the whole server, start it again at the same ports; seconds until it is healthy."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGCONT)
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait(timeout=60)
        self._wait_children_gone()
        if self._log is not None:
            self._log.close()
            self._log = None
        self.start()
        return self.wait_ready()

    def _wait_children_gone(self, timeout_s: float = 60) -> None:
        """Until no process of the server's session is left: its children release the GPU memory and the ports as
        they go (a server started next, or a restart, needs both)."""
        deadline = time.monotonic() + timeout_s
        while self._proc is not None and _session_pids(self._proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGCONT)
                os.killpg(self._proc.pid, signal.SIGTERM)
                self._proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._wait_children_gone()
        if self._log is not None:
            self._log.close()
            self._log = None


class LoopbackRollout:
    """A loopback engine (the CPU stand-in: SGLang's model classes in a gloo group, real Mooncake, no generation)."""

    kind = "loopback"
    generates = False

    def __init__(self, name: str, model_dir: str | Path, log_path: str | Path, *, tp: int = 1, ep: int = 1, **_: Any):
        from verl_p2p.loopback.engine import EngineSpec, LoopbackEngine

        self.name, self.model_dir = name, str(model_dir)
        self.engine = LoopbackEngine(EngineSpec(tp=tp, ep=ep, dtype=_checkpoint_dtype(model_dir)), self.model_dir)

    @property
    def url(self) -> str:
        return self.engine.url

    @property
    def bootstrap_url(self) -> str:
        return self.engine.bootstrap_url

    def start(self) -> LoopbackRollout:
        self.started = time.perf_counter()
        self.engine.start()
        return self

    def wait_ready(self, timeout_s: float = 600) -> float:
        self.engine.wait_ready()
        return time.perf_counter() - self.started

    def alive(self) -> bool:
        return self.engine.ready

    def log_tail(self, lines: int = 40) -> str:
        return ""

    async def generate(self, client: Any, input_ids: list[int], max_new_tokens: int, timeout: float) -> None:
        return None  # the stand-in does not generate

    async def checksums(self, client: Any) -> dict[str, str]:
        return await checksums_of(self.name, client)

    def serving(self) -> bool:
        """Whether generation would be served now (the control plane is not paused)."""
        return not self.engine.state()["paused"]

    def violations(self, since: int) -> list[dict]:
        """What SGLang allows but p2p must never do (stale prefix cache served, resumed in a session), recorded."""
        return self.engine.violations(since)

    def event_count(self) -> int:
        return len(self.engine.events())

    def process_ids(self) -> list[int]:
        """The rank processes (the control plane is a thread of this process)."""
        return [self.engine.rank_pid(r) for r in range(self.engine.spec.tp) if self.engine.ranks_alive()[r]]

    def freeze(self) -> list[int]:
        """SIGSTOP every rank (what holds the weights and the Mooncake engine, as SGLang's schedulers do)."""
        for rank in range(self.engine.spec.tp):
            self.engine.freeze_rank(rank)
        return self.process_ids()

    def thaw(self) -> None:
        for rank in range(self.engine.spec.tp):
            self.engine.thaw_rank(rank)

    def restart(self) -> float:
        """Kill the engine and start a new one at the same ports (new ranks, new Mooncake sessions)."""
        import dataclasses

        from verl_p2p.loopback.engine import LoopbackEngine

        t0 = time.perf_counter()
        old = self.engine
        old.stop()
        spec = dataclasses.replace(old.spec, port=old.port, bootstrap_port=old.bootstrap_port)
        self.engine = LoopbackEngine(spec, self.model_dir).start().wait_ready()
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.engine.stop()


def _checkpoint_dtype(model_dir: str | Path) -> str:
    import json

    return json.loads((Path(model_dir) / "config.json").read_text()).get("torch_dtype", "float32")


def _session_pids(session: int) -> list[int]:
    """Live processes of Linux session `session` (what `start_new_session` made the server's)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == session and fields[0] != "Z":  # field 6 (session), after the state
            pids.append(int(entry))
    return sorted(pids)


def _process_title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

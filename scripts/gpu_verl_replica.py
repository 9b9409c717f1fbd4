#!/usr/bin/env python3
"""One GPU: verl's real SGLang rollout replica, synced by p2p through verl's real checkpoint-engine managers.

On one H200 (`--rollout sglang`, the default):

1. a local Ray cluster (1 GPU);
2. verl 0.9.1's SGLang rollout replica for a tiny Qwen3 (recipes/tiny/make_tiny.py, bf16, local tokenizer),
   resolved through verl's replica registry (so verl_p2p's P2PSGLangReplica applies) and launched in standalone
   mode (`init_standalone`: its own placement group, verl's CheckpointEngineWorker and SGLangHttpServer actors),
   `gpu_memory_utilization` small so a trainer fits beside it; checked: the class, and the live server's
   `engine_info_bootstrap_port` = base + replica rank, the transfer-engine seed on, the memory saver off;
3. the trainer: a verl RayWorkerGroup of one actor worker holding verl's MegatronEngine class over a
   Megatron-Bridge model of the same checkpoint on the same GPU (verl_p2p/e2e/verl_actor.py: the worker is
   scheduled without a GPU resource, because the replica's placement group holds the GPU, and given it by
   CUDA_VISIBLE_DEVICES in its Ray runtime env);
4. three syncs through verl's stock `CheckpointEngineManager` (backend verl_p2p), then three through
   `P2PCheckpointEngineManager`, each phase like a fresh run (global steps 0, 1, 2; trainer weights = the
   checkpoint x 1, 2, 1). Expectations come from the rollout's own load, never from p2p: the checksums SGLang's
   `weights_checker` reports before any sync (C0) and a greedy generation then (G0). Every sync: no error, the
   server's weight version and verl's `set_global_steps` stamp = the step, the `checkpoint_engine/p2p/*`
   metrics. Step 0: `check_weight_update_equal` (snapshot, reset_tensors, compare must pass, checker state
   `done`) and checksums = C0. Step 1 (x2, exact in bf16): every weight's checksum changed, and equal across the
   two managers. Step 2 (back to x1): checksums = C0 and the greedy generation = G0 (the same prompt ran on the
   x2 weights just before, so a prefix cache not flushed by the sync would show);
5. a JSON report (`--out`) with each step's outcome, timings, checks and metrics, written after every step; a
   short summary on stdout; exit status 1 when any check failed or a step did not run.

`--rollout loopback` runs the same flow on a CPU host: the CPU stand-in rollout (verl_p2p.loopback: SGLang's model
classes and loader in a process of their own, real Mooncake, SGLang's control routes; no generation) behind the
stand-in replica of tests/support/verl_workers.py (verl's SGLangReplica imports SGLang's GPU server), the trainer's
Megatron model on the CPU. CI runs it (tests/test_gpu_verl_replica.py).

Usage on the H200 (stack at /tmp/site):
  PYTHONPATH=/tmp/site:$PWD timeout 570 python3 scripts/gpu_verl_replica.py --out $OUT/verl_replica_h200.json
`--deadline` (default 520 s after start) stops starting steps so the report is complete before `timeout` fires; the
report is rewritten after every step, and the Ray workers' logs go next to it (`*_ray_logs.tgz`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from verl_p2p.e2e.run import Check  # noqa: E402 - one check record for both harnesses

# Every process of the run (this one, Ray's workers, SGLang's schedulers) gets these.
BASE_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_memory_monitor_refresh_ms": "0",
    # Ray leaves CUDA_VISIBLE_DEVICES alone in workers without GPU ids: the trainer's comes from its runtime env
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    "RAY_DEDUP_LOGS": "0",
    # NVLink multicast stays off on shared hosts (NCCL, PyTorch symmetric memory, NVSHMEM)
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "MOONCAKE_PROTOCOL": "tcp",  # the rollout ranks' transfer engines; the trainer's comes from the options
    "MC_LOG_LEVEL": "ERROR",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}
# SGLang 0.5.12 as the H200 image has it (no FlashAttention-3/FlashMLA kernels): verl_p2p/e2e/rollouts.py's flags
SGLANG_GPU_KWARGS = {
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": True,
    "grammar_backend": "none",
    "random_seed": 0,
}
DISTRIBUTIONS = (
    "torch",
    "ray",
    "verl",
    "sglang",
    "megatron-core",
    "megatron-bridge",
    "transformers",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine-non-cuda",
)
PROMPT = [11, 17, 42, 99, 7, 150, 23, 88, 5, 61, 200, 14, 9, 77, 31, 128]
NEW_TOKENS = 16
# (global step, trainer weights = checkpoint x factor) of each phase: a fresh run's first three syncs
SYNCS = ((0, 1.0), (1, 2.0), (2, 1.0))
PHASES = ("stock", "p2p_manager")
# SGLang's weights_checker hashes these buffers too; no sync writes them (verl_p2p writes parameters)
NOT_WRITTEN = ("cos_sin_cache", "inv_freq", "freqs_cis", "_weight_fp32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollout", choices=("sglang", "loopback"), default="sglang")
    p.add_argument("--out", type=Path, default=None, help="default: $OUT/verl_replica.json, else in a new temp dir")
    p.add_argument("--workdir", type=Path, default=None, help="the checkpoint's folder (default: a new temp dir)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default: bf16 (sglang), fp32")
    p.add_argument("--replica-rank", type=int, default=1, help="> 0 shows the per-replica bootstrap port")
    p.add_argument("--bootstrap-port", type=int, default=26789, help="base engine_info_bootstrap_port")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--gpu", default=None, help="the GPU the trainer uses (default: the first visible)")
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--phases", default=",".join(PHASES), help="comma list of " + ", ".join(PHASES))
    p.add_argument("--no-verify-first-push", dest="verify_first_push", action="store_false")
    p.add_argument("--setup-timeout", type=float, default=420.0)
    p.add_argument("--sync-timeout", type=float, default=180.0)
    p.add_argument("--deadline", type=float, default=520.0, help="seconds after start: stop starting steps")
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown:
        p.error(f"--phases: unknown {unknown}; choose from {list(PHASES)}")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.rollout == "sglang" else "float32"
    if args.gpu is None:
        args.gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    if args.out is None:  # never a fixed name in the shared /tmp
        args.out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="verl_replica-")) / "verl_replica.json"
    return args


# ---- configuration -------------------------------------------------------------------------------------------


def environment(args: argparse.Namespace) -> dict[str, str]:
    """The environment of the driver and of Ray's workers (repo importable; for the loopback also tests/)."""
    env = dict(BASE_ENV)
    paths = [str(ROOT)] + ([str(ROOT / "tests")] if args.rollout == "loopback" else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    if args.rollout == "loopback":
        env["OMP_NUM_THREADS"] = "1"
    return env


def p2p_options(args: argparse.Namespace, hostname: str) -> dict[str, Any]:
    """`engine_kwargs.verl_p2p`: conf/p2p/default.yaml's defaults with TCP, this host, smaller slots, the check."""
    from verl_p2p.config import P2PConfig

    options = {
        "protocol": "tcp",
        "hostname": hostname,
        "bucket_size_mb": args.bucket_mb,
        "http_timeout": 60.0,
        "p2p_transfer_timeout": 60.0,
        "check_weight_update_equal": True,
        "verify_first_push": args.verify_first_push,
    }
    P2PConfig.from_mapping(options)  # refuses a bad option here, naming it
    return options


def checkpoint_engine(options: dict[str, Any]) -> dict[str, Any]:
    """verl's `rollout.checkpoint_engine` section for backend verl_p2p (options under the backend's name)."""
    return {
        "backend": "verl_p2p",
        "update_weights_bucket_megabytes": 64,
        "custom_backend_module": "verl_p2p",
        "engine_kwargs": {"verl_p2p": dict(options)},
    }


def sglang_engine_kwargs(args: argparse.Namespace, bootstrap_port: int) -> dict[str, Any]:
    """`engine_kwargs.sglang`: conf/p2p/default.yaml's p2p server args (`bootstrap_port` is the BASE: the replica
    wrapper adds the replica rank), and on the GPU the kernels the H200 image has."""
    from omegaconf import OmegaConf

    from verl_p2p.rollout.launch import BOOTSTRAP_PORT, check_server_args

    conf = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "p2p" / "default.yaml"), resolve=False)
    sglang = dict(conf["actor_rollout_ref"]["rollout"]["engine_kwargs"]["sglang"])
    sglang[BOOTSTRAP_PORT] = bootstrap_port
    check_server_args(sglang)
    if args.rollout == "sglang":
        sglang.update(SGLANG_GPU_KWARGS)
    return sglang


def rollout_config(args: argparse.Namespace, ce: dict[str, Any], sglang: dict[str, Any]) -> Any:
    """verl's RolloutConfig of one standalone SGLang replica (TP 1) on this host's one GPU."""
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    return RolloutConfig(
        name="sglang",
        mode="async",
        nnodes=1,
        n_gpus_per_node=1,
        tensor_model_parallel_size=1,
        data_parallel_size=1,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=True,
        load_format="auto",  # the checkpoint's weights: the weights check and C0 compare against them
        free_cache_engine=True,  # verl's default: the stock manager releases/resumes the KV cache around a sync
        skip_tokenizer_init=True,
        checkpoint_engine=CheckpointEngineConfig(**ce),
        engine_kwargs={"sglang": dict(sglang)},
    )


def write_checkpoint(workdir: Path, dtype: str) -> Path:
    """recipes/tiny/make_tiny.py's model and tokenizer (bf16); cast to `dtype` if another."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny", ROOT / "recipes" / "tiny" / "make_tiny.py")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    path = workdir / "model"
    make_tiny.write_model(path, seed=0)
    make_tiny.write_tokenizer(path)
    if dtype != "bfloat16":
        import torch
        from safetensors.torch import load_file, save_file

        loaded = load_file(path / "model.safetensors")
        tensors = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in loaded.items()}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((path / "config.json").read_text())
        config["torch_dtype"] = dtype
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def written_keys(checksums: dict[str, str]) -> list[str]:
    """The checksummed tensors a sync writes (every parameter; not the rotary caches SGLang computes)."""
    return sorted(k for k in checksums if not any(p in k for p in NOT_WRITTEN))


def compare_checksums(got: dict[str, str], want: dict[str, str]) -> tuple[bool, str]:
    """Equal key sets and values; the detail names the first differences."""
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        return False, f"tensor sets differ: missing {missing[:5]}, extra {extra[:5]}"
    diff = sorted(k for k in want if got[k] != want[k])
    return (not diff), (f"{len(diff)}/{len(want)} differ: {diff[:5]}" if diff else f"{len(want)} tensors equal")


# ---- report --------------------------------------------------------------------------------------------------


@dataclass
class Step:
    name: str
    outcome: str = "pending"  # ok | failed | timeout | skipped
    seconds: float = 0.0
    error: str = ""
    checks: list[Check] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)


class Report:
    def __init__(self, path: Path, args: argparse.Namespace):
        self.path = path
        self.t0 = time.monotonic()
        self.data: dict[str, Any] = {
            "script": "scripts/gpu_verl_replica.py",
            "argv": sys.argv[1:],
            "rollout": args.rollout,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host": socket.gethostname(),
            "versions": {},
            "steps": [],
        }
        self.steps: list[Step] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def add(self, step: Step) -> Step:
        self.steps.append(step)
        return step

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(s.outcome == "ok" and all(c.ok for c in s.checks) for s in self.steps)

    def write(self) -> None:
        self.data["steps"] = [asdict(s) for s in self.steps]
        self.data["wall_s"] = round(self.elapsed(), 2)
        self.data["ok"] = self.ok
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)

    def summary(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        lines = [f"verl replica run ({self.data['rollout']}): {verdict} in {self.elapsed():.0f} s"]
        for s in self.steps:
            bad = [c for c in s.checks if not c.ok]
            mark = "ok  " if s.outcome == "ok" and not bad else "FAIL"
            extra = f" {s.error.splitlines()[0][:160]}" if s.error else ""
            gbps = s.info.get("metrics", {}).get("checkpoint_engine/p2p/gbps")
            rate = f" {gbps:.2f} GB/s" if isinstance(gbps, (int, float)) else ""
            passed = f"{len(s.checks) - len(bad)}/{len(s.checks)} checks"
            lines.append(f"  {mark} {s.name:<28} {s.outcome:<7} {s.seconds:7.1f} s  {passed}{rate}{extra}")
            lines += [f"       x {c.name}: {c.detail[:200]}" for c in bad]
        lines.append(f"report: {self.path}")
        return "\n".join(lines)


class StepTimeout(Exception):
    pass


def call_with_timeout(fn, timeout: float, *args, **kwargs) -> Any:
    """fn(*args, **kwargs) in a daemon thread; StepTimeout if it does not return within `timeout` (it keeps
    running: the run then ends without waiting for it)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(max(timeout, 1.0))
    if thread.is_alive():
        raise StepTimeout(f"did not finish within {timeout:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---- the run -------------------------------------------------------------------------------------------------


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.report = Report(args.out, args)
        self.replica: Any = None
        self.actor_wg: Any = None
        self.engine: Any = None  # the loopback engine (CPU stand-in)
        self.client: Any = None
        self.c0: dict[str, str] = {}
        self.g0: list[int] | None = None
        self.scaled: dict[str, Any] = {}  # phase -> (checksums, generation) of the x2 sync
        self.managers: dict[str, Any] = {}  # phase -> its checkpoint-engine manager
        self.hung = False

    # ---- steps --------------------------------------------------------------------------------------------

    def step(self, name: str, fn, timeout: float, threaded: bool = True) -> Step:
        """Run one step unless the deadline is near or a step hung; record its outcome; rewrite the report."""
        step = self.report.add(Step(name))
        left = self.args.deadline - self.report.elapsed()
        if self.hung or left < 20:
            step.outcome = "skipped"
            step.error = "an earlier step hung" if self.hung else f"deadline ({self.args.deadline:.0f} s) reached"
        else:
            t0 = time.perf_counter()
            try:
                if threaded:
                    call_with_timeout(fn, min(timeout, left - 10), step)
                else:  # ray.init installs signal handlers: main thread only
                    fn(step)
                step.outcome = "ok"
            except StepTimeout as exc:
                step.outcome, step.error, self.hung = "timeout", str(exc), True
            except Exception as exc:  # noqa: BLE001 - recorded; the next steps still run
                step.outcome = "failed"
                step.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            step.seconds = round(time.perf_counter() - t0, 3)
        self.report.write()
        print(f"[verl_replica] {step.name}: {step.outcome} ({step.seconds:.1f} s)", flush=True)
        return step

    def main(self) -> int:
        args = self.args
        env = environment(args)
        os.environ.update(env)
        self.env = env
        self.report.data["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        self.step("versions", self.versions, 120)
        self.step("checkpoint", self.make_checkpoint, 120)
        self.step("ray", self.start_ray, 120, threaded=False)
        setup = self.step("replica_and_trainer", self.start_replica_and_trainer, args.setup_timeout)
        if setup.outcome == "ok":
            self.step("server_args", self.check_server_args, 60)
            baseline = self.step("baseline", self.baseline, 60)
            if baseline.outcome == "ok":
                for phase in args.phases:
                    manager = self.step(f"{phase}/manager", lambda s, p=phase: self.make_manager(p, s), 60)
                    if manager.outcome != "ok":
                        continue
                    for global_steps, factor in SYNCS:
                        timeout = args.sync_timeout * (2 if global_steps == 0 else 1)
                        self.step(
                            f"{phase}/sync{global_steps}_x{factor:g}",
                            lambda s, p=phase, g=global_steps, f=factor: self.sync(p, g, f, s),
                            timeout,
                        )
                    if hasattr(self.managers.get(phase), "close"):
                        with contextlib.suppress(Exception):
                            self.managers[phase].close()
                self.step("cross_manager", self.cross_manager, 10)
        self.report.write()
        print(self.report.summary(), flush=True)
        return 0 if self.report.ok else 1

    # ---- set-up -------------------------------------------------------------------------------------------

    def versions(self, step: Step) -> None:
        import importlib.metadata as md

        out = {"python": sys.version.split()[0]}
        for dist in DISTRIBUTIONS:
            with contextlib.suppress(md.PackageNotFoundError):
                out[dist] = md.version(dist)
        if self.args.rollout == "sglang":
            import torch

            out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
            step.check("gpu_visible", torch.cuda.is_available(), str(out["gpu"]))
        self.report.data["versions"] = out

    def make_checkpoint(self, step: Step) -> None:
        workdir = self.args.workdir or Path(tempfile.mkdtemp(prefix="verl_replica-"))
        self.model_path = write_checkpoint(workdir, self.args.dtype)
        step.info["model"] = str(self.model_path)
        step.info["dtype"] = self.args.dtype

    def start_ray(self, step: Step) -> None:
        import ray

        from verl_p2p.e2e.rollouts import local_ip

        sglang = self.args.rollout == "sglang"
        self.hostname = local_ip() if sglang else "127.0.0.1"
        ray.init(
            address="local",  # a cluster of its own
            num_cpus=8,  # logical: trainer (1), the replica's pool (2), its server actor (1), spare
            num_gpus=1 if sglang else 0,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",  # SGLang binds its bootstrap server to 127.0.0.1 too
            log_to_driver=sglang,  # on the GPU host the workers' errors land in this run's output
            runtime_env={"env_vars": dict(self.env)},
            _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
        )
        step.info["resources"] = ray.cluster_resources()
        step.info["trainer_hostname"] = self.hostname
        if sglang:
            step.check("ray_sees_one_gpu", ray.cluster_resources().get("GPU") == 1.0, str(ray.cluster_resources()))

    def start_replica_and_trainer(self, step: Step) -> None:
        """The replica's launch (SGLang's start dominates) and the trainer's model build, concurrently."""
        from verl_p2p.e2e.verl_actor import actor_config, actor_group

        args = self.args
        self.options = p2p_options(args, self.hostname)
        self.ce = checkpoint_engine(self.options)
        device = "cuda" if args.rollout == "sglang" else "cpu"
        trainer_box: dict[str, Any] = {}

        def trainer() -> None:
            t0 = time.perf_counter()
            try:
                config = actor_config(str(self.model_path), self.ce, dtype=args.dtype)
                trainer_box["group"], trainer_box["answer"] = actor_group(
                    config, 1, device=device, cuda_visible_devices=args.gpu if device == "cuda" else ""
                )
            except BaseException as exc:  # noqa: BLE001 - reported below
                trainer_box["error"] = exc
                trainer_box["traceback"] = traceback.format_exc()
            trainer_box["seconds"] = time.perf_counter() - t0

        thread = threading.Thread(target=trainer, daemon=True)
        t0 = time.perf_counter()
        if args.rollout == "sglang":
            # the replica first: SGLang sizes its memory pool from the free memory it sees at start
            launching = threading.Thread(target=lambda: self._launch_sglang(step), daemon=True)
            launching.start()
            time.sleep(5)
            thread.start()
            launching.join()
        else:
            thread.start()
            self._launch_loopback(step)
        step.info["replica_launch_s"] = round(time.perf_counter() - t0, 2)
        thread.join()
        step.info["trainer_init_s"] = round(trainer_box.get("seconds", 0.0), 2)
        if "error" in trainer_box:
            step.info["trainer_traceback"] = trainer_box["traceback"]
            raise RuntimeError(f"trainer worker group: {trainer_box['error']}") from trainer_box["error"]
        if "replica_error" in step.info:
            raise RuntimeError(f"rollout replica launch failed: {step.info['replica_error'].splitlines()[0]}")
        self.actor_wg = trainer_box["group"]
        step.info["trainer"] = trainer_box["answer"]
        answer = trainer_box["answer"]
        engine, ce = answer["engine"], answer["checkpoint_engine"]
        step.check("trainer_engine_is_verls", engine.endswith("transformer_impl.MegatronEngine"), engine)
        step.check("trainer_checkpoint_engine", ce.endswith("P2PCheckpointEngine"), ce)
        if device == "cuda":
            step.check("trainer_on_gpu", answer["device"].startswith("cuda"), answer["device"])
            step.check(
                "trainer_and_rollout_share_the_gpu",
                step.info.get("rollout_visible_devices") == answer["cuda_visible_devices"],
                f"rollout worker {step.info.get('rollout_visible_devices')!r}, "
                f"trainer {answer['cuda_visible_devices']!r}",
            )
        from verl_p2p.rollout.client import SGLangClient

        self.client = SGLangClient(self.replica.server_address, timeout=60)

    def _launch_sglang(self, step: Step) -> None:
        import ray
        from verl.workers.config import HFModelConfig
        from verl.workers.rollout.replica import RolloutReplicaRegistry, get_rollout_replica_class

        try:
            args = self.args
            sglang = sglang_engine_kwargs(args, args.bootstrap_port)
            config = rollout_config(args, self.ce, sglang)
            model_config = HFModelConfig(path=str(self.model_path), load_tokenizer=False)
            loader = RolloutReplicaRegistry._registry["sglang"]
            cls = get_rollout_replica_class("sglang")
            step.info["replica_loader"] = f"{loader.__module__}.{loader.__qualname__}"
            step.info["replica_class"] = f"{cls.__module__}.{cls.__qualname__}"
            self.replica = cls(
                replica_rank=args.replica_rank, config=config, model_config=model_config, gpus_per_node=1
            )
            t0 = time.perf_counter()
            asyncio.run(self.replica.init_standalone())
            step.info["init_standalone_s"] = round(time.perf_counter() - t0, 2)
            step.info["server_address"] = self.replica.server_address
            step.info["rollout_mode"] = self.replica.rollout_mode.value
            worker = self.replica.workers[0]
            step.info["rollout_visible_devices"] = ray.get(worker.__ray_call__.remote(_visible_devices))
            step.info["rollout_worker_class"] = ray.get(worker.__ray_call__.remote(_worker_classes))
        except BaseException:  # noqa: BLE001 - reported by the caller
            step.info["replica_error"] = traceback.format_exc()

    def _launch_loopback(self, step: Step) -> None:
        """CPU stand-in: a loopback engine behind tests/support's stand-in replica (verl's RolloutReplica base,
        verl's CheckpointEngineWorker; the SGLang server actor and adapter stand-ins talk to the engine)."""
        if str(ROOT / "tests") not in sys.path:
            sys.path.insert(0, str(ROOT / "tests"))
        from support.verl_workers import LoopbackReplica, launch_replica
        from verl.workers.config import HFModelConfig

        from verl_p2p.loopback.engine import EngineSpec, LoopbackEngine

        try:
            args = self.args
            self.engine = LoopbackEngine(EngineSpec(tp=1, ep=1, dtype=args.dtype), str(self.model_path)).start()
            self.engine.wait_ready()
            sglang = sglang_engine_kwargs(args, self.engine.bootstrap_port)
            sglang["host"] = "127.0.0.1"
            config = rollout_config(args, self.ce, sglang)
            model_config = HFModelConfig(path=str(self.model_path), load_tokenizer=False)
            replica = LoopbackReplica(args.replica_rank, config, model_config, server_url=self.engine.url)
            step.info["replica_class"] = f"{type(replica).__module__}.{type(replica).__qualname__} (CPU stand-in)"
            self.replica = asyncio.run(launch_replica(replica))
            step.info["server_address"] = self.replica.server_address
            step.info["rollout_mode"] = self.replica.rollout_mode.value
        except BaseException:  # noqa: BLE001 - reported by the caller
            step.info["replica_error"] = traceback.format_exc()

    def check_server_args(self, step: Step) -> None:
        from verl_p2p.rollout.launch import BOOTSTRAP_PORT, MEMORY_SAVER, SEED_FLAG, check_live_server_args

        info = asyncio.run(self.client.server_info())
        keys = (
            BOOTSTRAP_PORT,
            SEED_FLAG,
            MEMORY_SAVER,
            "attention_backend",
            "sampling_backend",
            "disable_cuda_graph",
            "mem_fraction_static",
            "load_format",
            "tp_size",
            "dtype",
            "version",
            "host",
            "port",
        )
        step.info["server_info"] = {k: info.get(k) for k in keys}
        check_live_server_args(info, engine=self.args.replica_rank, url=self.client.url)
        step.check("live_server_args_accepted", True, "check_live_server_args passed")
        step.check("seed_via_transfer_engine_on", info.get(SEED_FLAG) is True, repr(info.get(SEED_FLAG)))
        step.check("memory_saver_off", info.get(MEMORY_SAVER) is False, repr(info.get(MEMORY_SAVER)))
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        loader = RolloutReplicaRegistry._registry.get("sglang")
        wrapped = getattr(loader, "original", None) is not None and loader.__module__ == "verl_p2p.backend.plugin"
        step.check("registry_sglang_loader_is_p2p_wrapper", wrapped, f"{loader.__module__}.{loader.__qualname__}")
        if self.args.rollout == "sglang":
            want = self.args.bootstrap_port + self.args.replica_rank
            got = info.get(BOOTSTRAP_PORT)
            step.check("bootstrap_port_is_base_plus_replica_rank", got == want, f"server {got}, base+rank {want}")
            launched = (self.replica.config.engine_kwargs or {}).get("sglang", {}).get(BOOTSTRAP_PORT)
            step.check("replica_config_port", launched == want, f"replica config {launched}")
            step.check(
                "replica_is_p2p_wrapper",
                type(self.replica).__name__ == "P2PSGLangReplica"
                and any(c.__name__ == "SGLangReplica" for c in type(self.replica).__mro__),
                " > ".join(c.__name__ for c in type(self.replica).__mro__[:3]),
            )
            attention = info.get("attention_backend")
            step.check("triton_attention", attention == "triton", str(attention))

    def baseline(self, step: Step) -> None:
        from verl_p2p.e2e.rollouts import checksums_of

        self.c0 = asyncio.run(checksums_of("rollout", self.client))
        step.info["checksummed_tensors"] = len(self.c0)
        step.info["written_tensors"] = len(written_keys(self.c0))
        step.check("checksums", len(written_keys(self.c0)) > 0, f"{len(self.c0)} tensors")
        if self.args.rollout == "sglang":
            self.g0 = self.generate()
            step.info["generation"] = self.g0
            step.check("generation", bool(self.g0) and len(self.g0) == NEW_TOKENS, str(self.g0))

    def generate(self) -> list[int] | None:
        if self.args.rollout != "sglang":
            return None
        from verl_p2p.e2e.rollouts import greedy_generate

        return asyncio.run(greedy_generate(self.client, PROMPT, NEW_TOKENS, timeout=60))

    # ---- syncs --------------------------------------------------------------------------------------------

    def make_manager(self, phase: str, step: Step) -> None:
        from verl.checkpoint_engine.base import CheckpointEngineManager
        from verl.workers.config import CheckpointEngineConfig

        from verl_p2p.backend.manager import P2PCheckpointEngineManager

        cls = CheckpointEngineManager if phase == "stock" else P2PCheckpointEngineManager
        manager = cls(config=CheckpointEngineConfig(**self.ce), actor_wg=self.actor_wg, replicas=[self.replica])
        step.info["manager"] = f"{type(manager).__module__}.{type(manager).__qualname__}"
        step.info["backend_class"] = f"{manager.backend_cls.__module__}.{manager.backend_cls.__qualname__}"
        resolved = manager.backend_cls.__name__ == "P2PCheckpointEngine"
        step.check("backend_resolved_by_verls_registry", resolved, step.info["backend_class"])
        self.managers[phase] = manager

    def sync(self, phase: str, global_steps: int, factor: float, step: Step) -> None:
        import ray

        from verl_p2p.e2e.rollouts import checksums_of

        manager = self.managers[phase]
        self.actor_wg.set_weights(factor)
        t0 = time.perf_counter()
        metrics = manager.update_weights(global_steps=global_steps) or {}
        step.info["update_weights_s"] = round(time.perf_counter() - t0, 3)
        step.info["metrics"] = metrics
        p2p_keys = [k for k in metrics if k.startswith("checkpoint_engine/p2p/")]
        step.check(
            "p2p_metrics",
            bool(p2p_keys) and metrics.get("checkpoint_engine/p2p/bytes", 0) > 0,
            f"{len(p2p_keys)} keys, bytes={metrics.get('checkpoint_engine/p2p/bytes')}",
        )
        version = asyncio.run(self.client.weight_version())
        step.check("weight_version", str(version) == str(global_steps), f"server {version!r}")
        server = self.replica.servers[0]
        stamped = ray.get(server.__ray_call__.remote(lambda self: self.global_steps), timeout=30)
        step.check("verl_set_global_steps", stamped == global_steps, f"server actor {stamped!r}")
        if global_steps == 0:
            state = self.checker_state(phase)
            step.check("check_weight_update_equal_ran", state == "done", f"checker state {state!r}")

        checksums = asyncio.run(checksums_of("rollout", self.client))
        generation = self.generate()
        step.info["generation"] = generation
        if factor == 1.0:
            ok, detail = compare_checksums(checksums, self.c0)
            step.check("checksums_equal_rollouts_own_load", ok, detail)
            if self.g0 is not None:
                step.check("generation_equals_rollouts_own", generation == self.g0, f"{generation} vs {self.g0}")
        else:
            written = written_keys(self.c0)
            same = [k for k in written if checksums.get(k) == self.c0.get(k)]
            step.check(
                "every_weight_changed",
                not same and set(checksums) == set(self.c0),
                f"{len(written) - len(same)}/{len(written)} changed; unchanged {same[:5]}",
            )
            self.scaled[phase] = (checksums, generation)

    def checker_state(self, phase: str) -> str | None:
        """Where check_weight_update_equal's checker ran: the driver's lifecycle (P2P manager) or the replica's
        leader engine inside verl's CheckpointEngineWorker (stock manager)."""
        import ray

        if phase == "p2p_manager":
            checker = getattr(self.managers[phase]._lifecycle, "checker", None)
            return None if checker is None else checker.state
        worker = self.replica.workers[0]
        return ray.get(worker.__ray_call__.remote(_leader_checker_state), timeout=30)

    def cross_manager(self, step: Step) -> None:
        """The x2 syncs of both managers left the same bytes (same checksums; same greedy generation)."""
        if len(self.scaled) < 2:
            step.check("both_managers_synced_x2", False, f"only {sorted(self.scaled)}")
            return
        (a, ga), (b, gb) = (self.scaled[p] for p in PHASES)
        ok, detail = compare_checksums(b, a)
        step.check("x2_checksums_equal_across_managers", ok, detail)
        if ga is not None:
            step.check("x2_generation_equal_across_managers", ga == gb, f"{ga} vs {gb}")

    # ---- tear-down ----------------------------------------------------------------------------------------

    def close(self) -> None:
        def shutdown() -> None:
            import ray

            if self.client is not None:
                with contextlib.suppress(Exception):
                    self.client.close()
            if ray.is_initialized():
                ray.shutdown()

        with contextlib.suppress(Exception):
            call_with_timeout(shutdown, 60)
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.stop()


def _leader_checker_state(worker: Any) -> str | None:
    """(In verl's CheckpointEngineWorker) the state of its p2p engine's weights checker."""
    return getattr(getattr(worker.checkpoint_engine, "_checker", None), "state", None)


def _visible_devices(worker: Any) -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def _worker_classes(worker: Any) -> str:
    return f"{type(worker).__name__} / {type(worker.server_adapter).__module__}"


def save_ray_logs(out: Path, limit_bytes: int = 4 << 20) -> Path | None:
    """The Ray session's worker logs (each up to `limit_bytes`), next to the report."""
    logs = Path("/tmp/ray/session_latest/logs")
    if not logs.is_dir():
        return None
    target = out.with_name(out.stem + "_ray_logs.tgz")
    with tarfile.open(target, "w:gz") as tar:
        for path in sorted(logs.iterdir()):
            if path.is_file() and path.suffix in (".out", ".err", ".log") and path.stat().st_size <= limit_bytes:
                tar.add(path, arcname=path.name)
    return target


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args)
    code = 1
    try:
        code = run.main()
    except BaseException:  # noqa: BLE001 - the report says what happened
        run.report.data["fatal"] = traceback.format_exc()
        run.report.write()
        print(run.report.data["fatal"], flush=True)
    finally:
        run.close()
        if args.rollout == "sglang":
            with contextlib.suppress(Exception):
                save_ray_logs(args.out)
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # a hung step's thread (or Ray's) must not keep the process alive

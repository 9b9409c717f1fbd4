"""`verl-p2p soak --rollout sglang|loopback`: hundreds of syncs from a trainer process into one rollout server
(real SGLang on a GPU host, or the loopback stand-in on CPU), a fault every `--fault-every`-th sync.

The e2e harness (`run.py`) drives it: the production SyncLifecycle (p2p_push_retries=1) and adapters, the trainer
process (its Megatron model, the real Writer and Mooncake), expectations from the rollouts' own loads (weight set 0
from the rollout before any sync, set 1 from a fresh rollout started on it). Syncs alternate sets 0 and 1. The
faults, in turn (a process restart counts against `--max-restarts` per kind; once used up, that kind is skipped):

- `trainer_killed`: the trainer SIGKILLed mid-push, half-way through its first batch of writes; a new trainer
  process starts.
  Predicted: the sync fails naming the dead trainer; the rollout is stale (paused, never resumed).
- `wrong_session`: the trainer writes to a Mooncake session nobody listens on (a stale plan after a restart).
  Predicted: fails naming that session; stale.
- `scheduler_frozen`: the server's scheduler processes SIGSTOPped when the push starts, SIGCONTed once the push and
  its re-push gave up. Predicted: fails, the writes "timed out"; stale.
- `server_restarted`: the server SIGKILLed and started again at the same ports when the push starts. Predicted:
  the push fails, the re-push re-reads the new rank info, aborts and begins the new server, writes it: the sync
  passes with every rank of it re-pushed.

After every sync: a failed one must leave the rollout not serving (a generation request is not answered within
`--probe-timeout`; the loopback: paused), a passed one must hold the checksums of its weight set and (real SGLang)
generate greedily what a fresh server with those weights generates (every `--generate-every`-th sync and always
around a fault: the faulted sync and its recovery); the loopback records no violation. The sync
after a fault must pass. Resources are sampled after every sync: this driver's and the trainer's RSS, open fds and
threads, and the server's RSS and GPU memory (nvidia-smi, per process of the server; real SGLang only). The JSON
has their slopes per 100 syncs after warm-up (per process instance: a restarted trainer or server starts a new
one, whose first `--warmup` syncs are left out too); RSS, fds or threads growing past the leak limits
(`verl_p2p/e2e/leaks.py`) fail the run. Exit status 1 when anything was not as predicted or a process leaked.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_p2p.e2e.leaks import LeakLimits, judge_leaks, proc_resources, slope_per_100

FAULTS = ("trainer_killed", "wrong_session", "scheduler_frozen", "server_restarted")
RESTARTING = {"trainer_killed": "trainer", "server_restarted": "server"}  # what the fault makes restart


@dataclass
class RealSoakOptions:
    rollout: str = "loopback"  # "sglang" or "loopback"
    syncs: int = 20
    fault_every: int = 5
    warmup: int = 5
    max_restarts: int | None = None  # per restarting fault kind; None: unbounded
    model: str = "qwen3"
    size: str | None = None  # None: "gpu" for sglang (the e2e's proven shape), "tiny" for loopback
    transfer_timeout: float = 3.0
    http_timeout: float = 10.0
    probe_timeout: float = 2.0
    gpu_sample_every: int = 5
    generate_every: int = 1  # greedy generations compared every N-th sync, and always around a fault
    mem_fraction: float | None = None  # None: computed from the GPU for real SGLang (e2e/mem_fraction.py)
    time_budget_s: float | None = None  # stop starting syncs after this long (the report says where it stopped)
    leak_limits: LeakLimits = field(default_factory=LeakLimits)  # growth after warm-up that fails the run
    workdir: str | None = None
    out: str | None = None
    command: str = ""
    log: Any = print


@dataclass
class Prediction:
    fails: bool
    names: list[str] = field(default_factory=list)  # each must appear in the sync's error
    retried: bool = False  # a passing sync: every rank of the rollout re-pushed


def predict(kind: str) -> Prediction:
    if kind == "trainer_killed":
        return Prediction(True, ["trainer process exited"])
    if kind == "wrong_session":
        return Prediction(True, ["127.0.0.1:1"])
    if kind == "scheduler_frozen":
        return Prediction(True, ["timed out after"])
    if kind == "server_restarted":
        return Prediction(False, retried=True)
    raise ValueError(f"unknown fault {kind!r}; known: {FAULTS}")


def _nvidia_smi(query: str) -> list[list[str]] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[p.strip() for p in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_memory_mb(pids: list[int]) -> tuple[float | None, float | None]:
    """(GPU memory used by `pids` together, None when nvidia-smi lists none of them, as in a container with its
    own pid namespace; memory used on GPU 0 in all: server and trainer). (None, None) without nvidia-smi."""
    apps, total = _nvidia_smi("--query-compute-apps=pid,used_memory"), _nvidia_smi("--query-gpu=memory.used")
    wanted, used, seen = set(pids), 0.0, False
    for parts in apps or []:
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in wanted:
            used, seen = used + float(parts[1]), True
    whole = float(total[0][0]) if total and total[0] and total[0][0].replace(".", "").isdigit() else None
    return (used if seen else None), whole


class RealSoak:
    """The harness, the fault schedule and the bookkeeping of one run."""

    def __init__(self, options: RealSoakOptions, workdir: Path) -> None:
        from verl_p2p.e2e.run import Harness, harness_args

        self.options, self.log = options, options.log
        if options.size is None:
            options.size = "gpu" if options.rollout == "sglang" else "tiny"
        args = harness_args(
            rollout=options.rollout,
            models=[options.model],
            size=options.size,
            device="cuda" if options.rollout == "sglang" else "cpu",
            syncs=options.syncs,
            drills=[],
            transfer_timeout=options.transfer_timeout,
            http_timeout=options.http_timeout,
            mem_fraction=options.mem_fraction,
            raw_syncs=0,  # no raw-replay figures: every sync is a plain one
        )  # the soak's rollout serves the trainer's own bf16 checkpoint (fp8 off, the e2e's default)
        from verl_p2p.e2e.mem_fraction import e2e_mem_fraction

        self.mem_fraction = e2e_mem_fraction(args)  # refuses a run that fits no fraction, before anything starts
        args.mem_fraction = self.mem_fraction.value
        args.probe_timeout = options.probe_timeout  # the soak's own: how long the drills wait on a probe
        (workdir / options.model).mkdir(parents=True, exist_ok=True)
        self.harness = Harness(args, options.model, 0, workdir / options.model)
        self.restarts: Counter = Counter()
        self.faults: list[dict] = []
        self.unexpected: list[str] = []
        self.samples: dict[str, list[dict]] = {"driver": [], "trainer": [], "server": []}
        self.instances = {"trainer": (0, 0), "server": (0, 0)}  # (instance, first sync)
        self.stale_resumed: list[int] = []
        self.passed = self.failed = 0
        self.sync_seconds: list[float] = []
        self.stopped_at: int | None = None

    # ---- faults ----------------------------------------------------------------------------------------------

    def _next_fault(self, count: int) -> str | None:
        """The count-th fault kind in turn, skipping kinds whose restarts are used up."""
        for step in range(len(FAULTS)):
            kind = FAULTS[(count + step) % len(FAULTS)]
            limit = self.options.max_restarts
            if kind not in RESTARTING or limit is None or self.restarts[kind] < limit:
                return kind
        return None

    def _around(self, kind: str, notes: dict):
        """The push wrapper that injects `kind` (None for faults the harness drills itself)."""
        h = self.harness
        last = 1 + h.config.p2p_push_retries

        if kind == "scheduler_frozen":

            async def frozen(attempt: int, push):
                if attempt == 1:
                    notes["frozen_pids"] = h.rollout.freeze()
                try:
                    return await push()
                finally:
                    if attempt >= last:
                        h.rollout.thaw()  # the push and its re-push gave up: the server thaws

            return frozen
        if kind == "server_restarted":

            async def restarted(attempt: int, push):
                if attempt == 1:
                    notes["restart_s"] = round(await asyncio.to_thread(h.rollout.restart), 2)
                return await push()

            return restarted
        return None

    # ---- the run -----------------------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        opts, h = self.options, self.harness
        t0 = time.monotonic()
        await h.start()
        self.log(f"[soak] {opts.rollout} rollout, trainer and fresh rollout ready in {time.monotonic() - t0:.0f} s")
        setup_s = time.monotonic() - t0
        count = 0
        previous_fault = None
        for index in range(opts.syncs):
            if opts.time_budget_s is not None and time.monotonic() - t0 > opts.time_budget_s:
                self.stopped_at = index
                self.unexpected.append(f"stopped after {index} of {opts.syncs} syncs: --time-budget-s spent")
                self.log(f"[soak] time budget spent: stopping after {index} syncs")
                break
            weights = index % 2
            kind = None
            if opts.fault_every and index % opts.fault_every == opts.fault_every - 1 and index < opts.syncs - 1:
                kind = self._next_fault(count)
                count += 1
            notes: dict[str, Any] = {}
            drill = {"trainer_killed": "kill", "wrong_session": "wrong_session"}.get(kind or "", kind)
            s0 = time.monotonic()
            h.generate_next = kind is not None or previous_fault is not None or index % opts.generate_every == 0
            around = self._around(kind, notes) if kind else None
            settle = h.rollout.thaw if kind == "scheduler_frozen" else None  # thawed before the checks, whatever ran
            record = await h.sync(weights, drill, around_push=around, settle=settle)
            self.sync_seconds.append(time.monotonic() - s0)
            ok = record.outcome == "ok"
            self.passed += ok
            self.failed += not ok
            if kind in RESTARTING:
                self.restarts[kind] += 1
                self.instances[RESTARTING[kind]] = (self.restarts[kind], index + 1)
            bad = [c for c in record.checks if not c.ok]
            if record.outcome != "ok" and any(c.name == "unknown_weights_not_served" and not c.ok for c in bad):
                self.stale_resumed.append(index + 1)
            if kind is not None:
                self._judge(index + 1, kind, record, notes)
            else:
                if not ok:
                    self.unexpected.append(f"sync {index + 1} (no fault) failed: {record.error[:300]}")
                for c in bad:
                    what = "after a fault" if previous_fault else "(no fault)"
                    self.unexpected.append(f"sync {index + 1} {what}: check {c.name} failed: {c.detail[:200]}")
            previous_fault = kind
            self._sample(index + 1)
            if opts.out and (index + 1) % 25 == 0:  # a run cut short still leaves its numbers
                _write(opts.out, self._summary(time.monotonic() - t0, setup_s))
            if (index + 1) % 20 == 0 or kind is not None:
                d = self.samples["driver"][-1]
                tail = (
                    ""
                    if kind is None
                    else f" | {kind}: {record.outcome}, "
                    + ("as predicted" if self.faults[-1]["ok"] else "NOT AS PREDICTED")
                )
                self.log(
                    f"[soak] sync {index + 1}/{opts.syncs}: {self.passed} passed, {self.failed} failed; driver rss "
                    f"{d['rss_mb']:.0f} MB, fds {d['fds']}, threads {d['threads']}{tail}"
                )
        return self._summary(time.monotonic() - t0, setup_s)

    def _judge(self, sync: int, kind: str, record: Any, notes: dict) -> None:
        expect = predict(kind)
        problems = []
        failed = record.outcome != "ok"
        if failed != expect.fails:
            problems.append("the sync " + ("failed: " + record.error[:300] if failed else "passed"))
        missing = [n for n in expect.names if n not in record.error]
        if failed and missing:
            problems.append(f"the error does not name {missing}: {record.error[:300]}")
        if failed and not record.notes.get("stale_engines"):
            problems.append("the failed sync left no replica stale")
        ranks = getattr(self.harness.rollout, "tp", 1)
        if expect.retried and len(record.notes.get("retried", [])) != ranks:
            problems.append(f"re-pushed {record.notes.get('retried')}, predicted every rank of engine 0")
        problems += [f"check {c.name} failed: {c.detail[:200]}" for c in record.checks if not c.ok]
        self.faults.append(
            {
                "sync": sync,
                "kind": kind,
                "outcome": record.outcome,
                "named": not missing,
                "ok": not problems,
                "problems": problems,
                "error": record.error[:400],
                "retried": record.notes.get("retried", []),
                **notes,
            }
        )
        self.unexpected += [f"sync {sync} {kind}: {p}" for p in problems]

    def _sample(self, sync: int) -> None:
        h = self.harness
        driver = proc_resources()
        self.samples["driver"].append({"sync": sync, "instance": 0, "instance_start": 0, **driver})
        instance, start = self.instances["trainer"]
        trainer = proc_resources(h.trainer.pid) if h.trainer.pid else None
        if trainer is not None:
            self.samples["trainer"].append({"sync": sync, "instance": instance, "instance_start": start, **trainer})
        instance, start = self.instances["server"]
        pids = h.rollout.process_ids()
        parts = [r for r in (proc_resources(p) for p in pids) if r is not None]
        server: dict[str, Any] = {"sync": sync, "instance": instance, "instance_start": start}
        server["rss_mb"] = sum(r["rss_mb"] for r in parts)
        server["fds"] = sum(r["fds"] for r in parts)
        server["threads"] = sum(r["threads"] for r in parts)
        every = self.options.gpu_sample_every
        if self.options.rollout == "sglang" and every and sync % every == 0:
            server["gpu_mb"], server["gpu0_total_mb"] = gpu_memory_mb(pids)
        self.samples["server"].append(server)

    def _summary(self, seconds: float, setup_s: float) -> dict[str, Any]:
        warm = self.options.warmup
        slopes, leaks = judge_leaks(self.samples, warm, self.options.leak_limits)
        for k in ("gpu_mb", "gpu0_total_mb"):  # reported, not judged: nvidia-smi is not always there to read
            slopes["server"][f"{k}_per_100_syncs"] = slope_per_100(self.samples["server"], k, warm)
        last = {who: (s[-1] if s else None) for who, s in self.samples.items()}
        by_kind = Counter(f["kind"] for f in self.faults)
        return {
            "command": self.options.command,
            "rollout": self.options.rollout,
            "mem_fraction": self.mem_fraction.to_dict(),
            "model": f"{self.options.model} ({self.options.size})",
            "syncs": self.options.syncs,
            "syncs_run": len(self.sync_seconds),
            "stopped_at": self.stopped_at,
            "fault_every": self.options.fault_every,
            "warmup_syncs": warm,
            "passed": self.passed,
            "failed": self.failed,
            "faults_injected": len(self.faults),
            "faults_by_kind": dict(sorted(by_kind.items())),
            "faults_as_predicted": sum(f["ok"] for f in self.faults),
            "faults_named_correctly": sum(f["named"] for f in self.faults),
            "restarts": dict(self.restarts),
            "stale_replicas_resumed": len(self.stale_resumed),
            "stale_replicas_resumed_at_syncs": self.stale_resumed,
            "ok": not self.unexpected and not leaks,
            "unexpected": self.unexpected,
            "leaks": leaks,
            "leak_limits": asdict(self.options.leak_limits),
            "slopes_after_warmup": slopes,
            "last_sample": last,
            "seconds_total": round(seconds, 1),
            "seconds_setup": round(setup_s, 1),
            "seconds_per_sync": {
                "median": round(sorted(self.sync_seconds)[len(self.sync_seconds) // 2], 3) if self.sync_seconds else 0,
                "max": round(max(self.sync_seconds), 3) if self.sync_seconds else 0,
            },
            "config": {
                "p2p_transfer_timeout": self.options.transfer_timeout,
                "http_timeout": self.options.http_timeout,
                "p2p_push_retries": self.harness.config.p2p_push_retries,
                "probe_timeout": self.options.probe_timeout,
                "generate_every": self.options.generate_every,
                "max_restarts": self.options.max_restarts,
                "time_budget_s": self.options.time_budget_s,
            },
            "faults": self.faults,
            "samples": self.samples,
        }


def run_real_soak(options: RealSoakOptions) -> dict[str, Any]:
    """Run it; returns the report (also written to `options.out` when set)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if options.rollout != "sglang":
        from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

        install_cpu_stubs()
    with tempfile.TemporaryDirectory(prefix="verl-p2p-soak-") as tmp:
        soak = RealSoak(options, Path(options.workdir or tmp))
        try:
            report = asyncio.run(soak.run())
        except Exception as exc:  # noqa: BLE001 - reported with what ran so far
            report = soak._summary(0.0, 0.0)
            report.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            rollout = getattr(soak.harness, "rollout", None)
            if rollout is not None:
                report["rollout_log_tail"] = rollout.log_tail()
        finally:
            soak.harness.stop()
    if options.out:
        _write(options.out, report)
    return report


def _write(path: str, report: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(path)

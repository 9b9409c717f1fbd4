"""The in-process loopback soak behind `verl-p2p soak` (without `--rollout`; the command: verl_p2p/cli/soak.py).

This process is the driver: the production SyncLifecycle, replica adapters and HTTP clients, the real Writer and a
Mooncake endpoint, through the loopback's stand-in trainer (loopback/mirror_push.py: each rank's start-up weights
scaled per version). The engines (default TP2/EP2, TP1, TP1, claiming SGLang 0.5.23: weight-update sessions) run in a
child process (loopback/host.py), so the resources sampled here are the sync's own. Every sync runs in a fresh
event loop (`asyncio.run`), as verl drives the sync in some trainer modes.

Every `--fault-every`-th sync but the last gets the next fault of FAULTS, on the next engine and rank in turn: a
rank frozen or killed mid-push, a transient freeze, a partial push (writes to one rank fail after its first batch),
a transient one, HTTP 500 and 404 answers, a control call held past http_timeout, a cache flush refused a few
times or for good. Checked after every sync:
- an engine that is generating holds exactly the bytes its reported weight version names (else it counts as a
  stale replica resumed), and recorded no loopback violation (stale prefix cache served, generation resumed inside
  a session or with its KV released);
- the paused engines are exactly those the lifecycle reports stale;
- a sync with a fault fails or passes as the fault predicts, its error names the fault's engine (and rank) and
  what happened, and exactly the predicted replicas are left stale; a sync without one passes, resuming what the
  previous one left stale.
RSS, open file descriptors and threads of this process are sampled after every sync; growth after the warm-up
(an engine that rejoins starts a new baseline) past the leak limits (`verl_p2p/e2e/leaks.py`, `--leak-*`) fails
the run. Writes JSON (`--out`), prints a summary, exits 1 when anything was not as predicted or this process leaked.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_p2p.e2e.leaks import LeakLimits, judge_leaks, proc_resources, slope_per_100

FAULTS = (
    "frozen_rank",
    "http_500",
    "partial_push",
    "transient_freeze",
    "slow_control_call",
    "flush_busy",
    "http_404",
    "transient_partial_push",
    "flush_refused",
    "killed_rank",
)
VIOLATIONS = ("served_stale_prefix_cache", "resumed_inside_weight_update_session", "resumed_with_kv_cache_released")


@dataclass
class SoakOptions:
    syncs: int = 200
    fault_every: int = 10
    warmup: int = 20
    http_timeout: float = 5.0
    transfer_timeout: float = 2.0
    rank_timeout: float = 4.0
    engines: tuple[tuple[int, int], ...] = ((2, 2), (1, 1), (1, 1))  # (tp, ep) per loopback engine
    out: str | None = None
    command: str = ""
    log: Callable[[str], None] = print
    leak_limits: LeakLimits = field(default_factory=LeakLimits)  # growth after warm-up that fails the run


@dataclass
class Expect:
    """What a fault must do to its sync."""

    fails: bool
    names: list[str]  # every one must appear in the error
    stale: set[int] = field(default_factory=set)
    retried: list | None = None  # the targets re-pushed within a sync that passes


def _scale(version: str) -> float:
    """The factor every rank's start-up weights are scaled by at `version` ("default": the loaded weights)."""
    if version == "default":
        return 1.0
    return 1.0 + (int(version) % 15 + 1) / 16.0


def _resources() -> dict[str, float]:
    """This process's RSS, fds and threads (the shared sampler), and its Python threads."""
    return {**proc_resources(), "python_threads": threading.active_count()}


class Soak:
    """One soak run: the host with the engines, the lifecycle, the stand-in trainer, the bookkeeping."""

    def __init__(self, options: SoakOptions, workdir: Path) -> None:
        from verl_p2p.config import P2PConfig
        from verl_p2p.loopback.engine import EngineSpec
        from verl_p2p.loopback.host import LoopbackHost
        from verl_p2p.loopback.mirror_push import MirrorPush
        from verl_p2p.planning.targets import TargetRank
        from verl_p2p.rollout.lifecycle import SyncLifecycle
        from verl_p2p.sandbox.tiny import write_tiny_checkpoint

        self.options, self.log = options, options.log
        self.config = P2PConfig(
            protocol="tcp",
            hostname="127.0.0.1",
            http_timeout=options.http_timeout,
            p2p_transfer_timeout=options.transfer_timeout,
            p2p_push_retries=1,
        )
        model = write_tiny_checkpoint(workdir / "qwen3_moe", "qwen3_moe", id_encoded=False)
        specs = [
            EngineSpec(tp=tp, ep=ep, sglang_version="0.5.23", rank_timeout_s=options.rank_timeout)
            for tp, ep in options.engines
        ]
        t0 = time.monotonic()
        self.host = LoopbackHost(specs, str(model))
        self.log(f"[soak] {len(specs)} loopback engines ready in {time.monotonic() - t0:.0f} s")
        self.tp = {e: spec.tp for e, spec in enumerate(specs)}
        self.addresses = {e: self.host.address(e) for e in self.tp}
        witness = {TargetRank(e, r): self.host.dump(e, r) for e, tp in self.tp.items() for r in range(tp)}
        self.mirror = MirrorPush(
            witness, lambda t: self.host.dump(t.engine, t.rank), timeout_s=options.transfer_timeout
        )
        self.lifecycle = SyncLifecycle([self._adapter(e) for e in self.tp], self.config, frees_kv=True)
        self.restarting: set[int] = set()
        self.rejoined: list[dict] = []  # {"engine", "before_sync"}: restarted engines back in the rollout
        self.marks = {e: 0 for e in self.tp}
        self.faults: list[dict] = []
        self.unexpected: list[str] = []
        self.stale_served: list[dict] = []
        self.violations: Counter = Counter()
        self.samples: list[dict] = []
        self.passed = 0
        self.failed = 0
        self.sync_seconds: list[float] = []
        self.instance = (0, 0)  # (instance, first sync) of this process's resources: an engine rejoining starts one

    def _adapter(self, engine: int) -> Any:
        from verl_p2p.rollout.adapter import P2PReplicaAdapter

        address = self.addresses[engine]
        return P2PReplicaAdapter(engine, address.url, bootstrap_url=address.bootstrap_url, config=self.config)

    # ---- faults ----------------------------------------------------------------------------------------------

    def _victim(self, k: int) -> tuple[int, int]:
        present = sorted(e for e in self.tp if e not in self.restarting)
        engine = present[k % len(present)]
        return engine, (k // len(present)) % self.tp[engine]

    def _arm(self, kind: str, engine: int, rank: int) -> tuple[Expect, Callable[[], None]]:
        """Arm `kind` on (engine, rank); returns what it must do and how to undo it after the sync."""
        from verl_p2p.planning.targets import TargetRank

        host, mirror, target = self.host, self.mirror, TargetRank(engine, rank)
        where, on = f"engine {engine} rank {rank}", f"on engine {engine}"
        done: list[bool] = []

        def at_first_batch(action: Callable[[], None]) -> Callable[[int], None]:
            def hook(batch: int) -> None:
                if batch == 0 and not done:
                    done.append(True)
                    action()

            return hook

        def nothing() -> None:
            pass

        if kind == "frozen_rank":
            mirror.after_batch = at_first_batch(lambda: host.call("freeze_rank", engine, rank))
            return Expect(True, [where, "timed out"], {engine}), lambda: host.call("thaw_rank", engine, rank)
        if kind == "transient_freeze":
            mirror.after_batch = at_first_batch(lambda: host.call("freeze_rank", engine, rank))
            mirror.after_write = lambda: done and host.call("thaw_rank", engine, rank)
            return Expect(False, [], retried=[target]), lambda: host.call("thaw_rank", engine, rank)
        if kind == "killed_rank":
            mirror.after_batch = at_first_batch(lambda: host.call("kill_rank", engine, rank))
            return Expect(True, [where], {engine}), lambda: self._restart(engine)
        if kind == "partial_push":
            mirror.fail_writes(target, pushes=2)
            return Expect(True, [where, "injected write failure"], {engine}), nothing
        if kind == "transient_partial_push":
            mirror.fail_writes(target, pushes=1)
            return Expect(False, [], retried=[target]), nothing
        if kind == "http_500":
            host.call("fail", engine, "/update_weight_version", 500, "scheduler crashed", times=1)
            return Expect(True, [f"bump_version {on}", "HTTP 500"], {engine}), nothing
        if kind == "http_404":
            host.call("fail", engine, "/pause_generation", 404, "Not Found", times=1)
            return Expect(True, [f"abort {on}", "HTTP 404"]), nothing
        if kind == "slow_control_call":
            host.call("slow", engine, "/end_weight_update", self.options.http_timeout + 1.0, times=1)
            return Expect(True, [f"end {on}", "no answer within"], {engine}), nothing
        busy = "Cache not flushed because there are pending requests"
        if kind == "flush_busy":
            host.call("fail", engine, "/flush_cache", 400, busy, times=3)
            return Expect(False, []), lambda: host.call("clear_faults", engine)
        if kind == "flush_refused":
            host.call("fail", engine, "/flush_cache", 400, busy, times=None)
            expect = Expect(True, [f"flush_cache {on}", "cache still not flushed"], {engine})
            return expect, lambda: host.call("clear_faults", engine)
        raise ValueError(f"unknown fault {kind!r}")

    def _restart(self, engine: int) -> None:
        """The engine lost a rank: take it out of the rollout and restart it (joins again once it serves)."""
        self.lifecycle.remove_adapters([engine])
        self.host.call("restart", engine)
        self.restarting.add(engine)

    def _rejoin(self) -> None:
        for engine in sorted(self.restarting):
            address = self.host.address(engine)
            if address is not None:
                self.addresses[engine] = address
                self.marks[engine] = 0
                self.lifecycle.add_adapters([self._adapter(engine)])
                self.restarting.discard(engine)
                self.rejoined.append({"engine": engine, "before_sync": len(self.samples) + 1})
                self.instance = (self.instance[0] + 1, len(self.samples) + 1)  # new connections: a new baseline
                self.log(f"[soak] engine {engine} restarted and rejoined")

    # ---- one sync --------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from verl_p2p.rollout.lifecycle import SyncError

        opts = self.options
        start = time.monotonic()
        fault_count = 0
        for index in range(opts.syncs):
            self._rejoin()
            version = str(index + 1)
            fault = None
            # every fault_every-th sync, except the last: the run ends on a sync that recovers
            if opts.fault_every and index % opts.fault_every == opts.fault_every - 1 and index < opts.syncs - 1:
                kind = FAULTS[fault_count % len(FAULTS)]
                engine, rank = self._victim(fault_count)
                fault_count += 1
                expect, undo = self._arm(kind, engine, rank)
                fault = {"sync": index + 1, "kind": kind, "engine": engine, "rank": rank}
            stale_before = set(self.lifecycle.stale)
            t0 = time.monotonic()
            report, error = None, None
            try:
                report = asyncio.run(self.lifecycle.sync(version, self.mirror.push(_scale(version))))
            except SyncError as exc:
                error = exc
            finally:
                self.mirror.after_batch = self.mirror.after_write = None
            self.sync_seconds.append(time.monotonic() - t0)
            self.passed += error is None
            self.failed += error is not None
            if fault is not None:
                undo()
                self._judge_fault(fault, expect, report, error, stale_before)
            elif error is not None:
                self.unexpected.append(f"sync {version} (no fault) failed: {error}")
            elif stale_before - set(report.recovered_engines) - self.restarting:
                self.unexpected.append(f"sync {version} did not resume stale engines {sorted(stale_before)}")
            self._check_engines(version)
            instance, instance_start = self.instance
            self.samples.append(
                {"sync": index + 1, "instance": instance, "instance_start": instance_start, **_resources()}
            )
            if (index + 1) % 20 == 0 or fault is not None:
                s = self.samples[-1]
                outcome = "" if fault is None else f" | {fault['kind']} e{fault['engine']}r{fault['rank']}: "
                if fault is not None:
                    outcome += f"{fault['outcome']}, " + ("as predicted" if fault["ok"] else "NOT AS PREDICTED")
                self.log(
                    f"[soak] sync {index + 1}/{opts.syncs}: {self.passed} passed, {self.failed} failed; "
                    f"rss {s['rss_mb']:.1f} MB, fds {s['fds']}, threads {s['threads']}{outcome}"
                )
        return self._summary(time.monotonic() - start)

    def _judge_fault(self, fault: dict, expect: Expect, report: Any, error: Any, stale_before: set) -> None:
        text = str(error) if error is not None else ""
        problems = []
        if stale_before:
            problems.append(f"engines {sorted(stale_before)} were stale before the fault")
        if expect.fails != (error is not None):
            problems.append("the sync " + ("passed" if error is None else f"failed: {text[:300]}"))
        missing = [n for n in expect.names if n not in text]
        if error is not None and missing:
            problems.append(f"the error does not name {missing}: {text[:300]}")
        stale = set(error.stale_engines) if error is not None else set()
        if stale != expect.stale:
            problems.append(f"stale {sorted(stale)}, predicted {sorted(expect.stale)}")
        if expect.retried is not None and (report is None or report.retried_targets != expect.retried):
            got = None if report is None else report.retried_targets
            problems.append(f"re-pushed {got}, predicted {expect.retried}")
        fault.update(
            outcome="failed" if error is not None else "passed",
            stale=sorted(stale),
            named=not missing,
            ok=not problems,
            problems=problems,
            error=text[:400],
        )
        if report is not None and report.retried_targets:
            fault["retried"] = [str(t) for t in report.retried_targets]
        self.faults.append(fault)
        self.unexpected += [f"sync {fault['sync']} {fault['kind']}: {p}" for p in problems]

    def _check_engines(self, version: str) -> None:
        """Every generating engine holds exactly what its version names; the paused ones are the stale ones."""
        from verl_p2p.planning.targets import TargetRank

        stale = set(self.lifecycle.stale)
        for engine in sorted(set(self.tp) - self.restarting):
            state = self.host.call("state", engine)
            for violation in self.host.call("violations", engine, self.marks[engine]):
                self.violations[violation["path"]] += 1
                self.unexpected.append(f"after sync {version}: engine {engine}: {violation['message']}")
            self.marks[engine] = self.host.call("events_count", engine)
            if state["paused"] != (engine in stale):
                self.unexpected.append(
                    f"after sync {version}: engine {engine} paused={state['paused']} but stale={engine in stale}"
                )
            if state["paused"]:
                continue
            scale = _scale(state["weight_version"])
            for rank in range(self.tp[engine]):
                differing = self.mirror.differing(TargetRank(engine, rank), scale)
                if differing:
                    record = {"after_sync": version, "engine": engine, "rank": rank, "params": differing[:5]}
                    self.stale_served.append(record)
                    self.unexpected.append(f"after sync {version}: engine {engine} rank {rank} serves wrong bytes")

    def _summary(self, seconds: float) -> dict[str, Any]:
        warmup = self.options.warmup
        warm = [s for s in self.samples if s["sync"] > warmup] or self.samples
        slopes, leaks = judge_leaks({"driver": self.samples}, warmup, self.options.leak_limits)
        resources = {}
        for key in ("rss_mb", "fds", "threads", "python_threads"):
            values = [s[key] for s in warm]
            per_100 = slopes["driver"].get(f"{key}_per_100_syncs", slope_per_100(self.samples, key, warmup))
            resources[key] = {
                "after_warmup": values[0] if values else None,
                "final": values[-1] if values else None,
                "min": min(values, default=None),
                "max": max(values, default=None),
                "per_100_syncs": per_100,  # least squares after each instance's warm-up (engine rejoins: new ones)
            }
        by_kind = Counter(f["kind"] for f in self.faults)
        return {
            "command": self.options.command,
            "syncs": self.options.syncs,
            "fault_every": self.options.fault_every,
            "warmup_syncs": self.options.warmup,
            "passed": self.passed,
            "failed": self.failed,
            "faults_injected": len(self.faults),
            "faults_by_kind": dict(sorted(by_kind.items())),
            "faults_as_predicted": sum(f["ok"] for f in self.faults),
            "faults_named_correctly": sum(f["named"] for f in self.faults),
            "stale_replicas_resumed": len(self.stale_served),
            "stale_replicas_resumed_detail": self.stale_served,
            "engines_rejoined": self.rejoined,  # each brings new rank sessions (Mooncake connections: fds)
            "violations": {v: self.violations.get(v, 0) for v in VIOLATIONS},
            "unexpected": self.unexpected,
            "leaks": leaks,
            "leak_limits": asdict(self.options.leak_limits),
            "ok": not self.unexpected and not leaks,
            "resources": resources,
            "seconds_total": round(seconds, 1),
            "seconds_per_sync": {
                "median": round(sorted(self.sync_seconds)[len(self.sync_seconds) // 2], 3),
                "max": round(max(self.sync_seconds), 3),
            },
            "config": {
                "engines": [f"TP{tp}/EP{ep}" for tp, ep in self.options.engines],
                "http_timeout": self.options.http_timeout,
                "p2p_transfer_timeout": self.options.transfer_timeout,
                "p2p_push_retries": self.config.p2p_push_retries,
                "loopback_rank_timeout": self.options.rank_timeout,
            },
            "faults": self.faults,
            "samples": self.samples,
        }

    def close(self) -> None:
        self.lifecycle.close()
        self.mirror.close()
        self.host.stop()


def run_soak(options: SoakOptions) -> dict[str, Any]:
    """Run the soak; returns the report (also written to `options.out` when set)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()
    with tempfile.TemporaryDirectory(prefix="verl-p2p-soak-") as tmp:
        soak = Soak(options, Path(tmp))
        try:
            report = soak.run()
        finally:
            soak.close()
    if options.out:
        Path(options.out).parent.mkdir(parents=True, exist_ok=True)
        Path(options.out).write_text(json.dumps(report, indent=1) + "\n")
    return report

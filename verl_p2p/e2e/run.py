"""`verl-p2p e2e`: prove whole syncs into a rollout, three ways each, then drill failures; write a JSON report.

Per model: write a checkpoint (weight set 0), start the rollout under test from it, start the trainer process
(its Megatron model loaded from the same checkpoint), save weight set 1 as a checkpoint and start a FRESH rollout
from it. Expectations come from the rollouts' own loads, never from the replica: set 0's checksums and greedy
generation are the rollout's own before any sync, set 1's are the fresh rollout's. With `--one-server-at-a-time`
the fresh rollout answers and stops before the rollout under test starts, so the GPU holds one server at a time
(the same checks). Then:

1. sync set 0 with `check_weight_update_equal` (SGLang's weights_checker: snapshot -> reset_tensors -> sync ->
   compare must pass), then alternate sets 1 / 0 for the remaining syncs. Every sync: checksums equal the
   expectation, and (real SGLang) the first generation after the sync equals the expectation. The same prompt is
   sent before each sync, so a prefix cache still holding KV of the old weights shows up as a mismatch.
2. drills, each followed by a recovery sync that must restore exact weights and equal generations:
   `kill` (the trainer process SIGKILLed mid-push, half-way through its first batch of writes; checked: the rollout
   then holds some but not all new bytes), `wrong_session` (the push aimed at a Mooncake session that does not
   exist, as after a rollout restart), `paused_call` (control calls and a generation request sent while the
   rollout is paused for the sync: they must be answered, and the request must be served after the sync, with
   the new weights).
`--fp8`: every rollout (the one under test and the fresh ones) starts from the 128x128 block-FP8 copy of its
checkpoint that the trainer's quantizer writes (`trainer/fp8_checkpoint.py`), and the trainer, still bf16,
names it in `rollout_model_path`: every check above then proves FP8 bytes (needs `--size gpu`, whose shapes
are multiples of 128).
Exit status 1 when any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from verl_p2p.cli.help import parser as command_parser
from verl_p2p.e2e.checks import Check, Expectation, IndistinctWeightSetsError, require_distinct_generations
from verl_p2p.e2e.drills import Drills
from verl_p2p.e2e.records import SyncRecord, pause_and_raw_figures, paused_seconds, summary_text
from verl_p2p.e2e.sizes import SIZES, model_overrides

# the names tests and scripts import from here
_require_distinct_generations = require_distinct_generations
__all__ = ["SIZES", "Check", "Expectation", "Harness", "IndistinctWeightSetsError", "SyncRecord", "main"]

PROMPT = [3, 17, 42, 99, 7, 150, 23, 88, 5, 61, 200, 14, 9, 77, 31, 128]
# the generations a drill sends (while paused, while stale) use their own prompt: no prefix in common with PROMPT, so
# they never leave PROMPT in the radix cache when the check's own generation comes. A cached prompt's greedy output
# can differ from a fresh prefill's with the same bytes (near-tied logits of random weights: seen on the H200 at the
# Qwen3-4B shape, every checksum equal), and the check compares against a fresh prefill.
SIDE_PROMPT = [5, 250, 11, 64, 190, 2, 37, 140, 73, 19, 222, 8, 101, 46, 160, 27]
NEW_TOKENS = 16
DRILLS = ("kill", "wrong_session", "paused_call")


class Harness(Drills):
    """One model: its rollout under test, the trainer process, the expectations, the lifecycle."""

    def __init__(self, args: argparse.Namespace, arch: str, index: int, workdir: Path):
        self.args, self.arch, self.index, self.workdir = args, arch, index, workdir
        self.records: list[SyncRecord] = []
        self.info: dict[str, Any] = {"model": arch, "rollout": args.rollout}
        self.applied: tuple[int, int] | None = None  # (trainer instance, plan generation) the trainer holds
        self.trainer_instance = 0
        self.held = 0  # the weight set the rollout holds now
        self.stale = False  # the last sync left the rollout paused with unknown weights
        # generations sent while the rollout was stale, still held by it: (request, the server process it went to)
        self.held_generations: list[tuple[asyncio.Task, int]] = []
        self.generate_next = True  # the next sync checks greedy generations too (the soak skips some)

    # ---- set-up -----------------------------------------------------------------------------------------------

    def _rollout(self, name: str, model_dir: Path, replica_rank: int):
        from verl_p2p.e2e.rollouts import LoopbackRollout, SGLangServer

        cls = SGLangServer if self.args.rollout == "sglang" else LoopbackRollout
        if cls is SGLangServer and self.args.mem_fraction is None:  # parse_args / e2e_mem_fraction resolve it
            raise ValueError("a real SGLang server needs a mem fraction: resolve it with mem_fraction.e2e_mem_fraction")
        return cls(
            name,
            model_dir,
            self.workdir / f"{name}.log",
            replica_rank=replica_rank,
            base_bootstrap_port=self.args.bootstrap_port,
            mem_fraction=self.args.mem_fraction,
        )

    def _trainer(self):
        from verl_p2p.e2e.trainer import TrainerProcess, TrainerSpec

        self.trainer_instance += 1
        spec = TrainerSpec(
            model_dir=str(self.checkpoint),
            device=self.args.device,
            dtype=self.dtype,
            hostname=self.hostname,
            config=self.config_fields,
        )
        return TrainerProcess(spec)

    async def start(self) -> None:
        import torch

        from verl_p2p.config import P2PConfig
        from verl_p2p.e2e.rollouts import local_ip
        from verl_p2p.rollout.adapter import P2PReplicaAdapter
        from verl_p2p.rollout.client import SGLangClient
        from verl_p2p.rollout.lifecycle import SyncLifecycle
        from verl_p2p.sandbox.tiny import write_tiny_checkpoint

        args = self.args
        self.dtype = "bfloat16" if args.rollout == "sglang" or args.fp8 else "float32"  # SGLang's FP8: bf16 rest
        overrides = model_overrides(args.size, self.arch, args.layers)
        t0 = time.perf_counter()
        self.checkpoint = write_tiny_checkpoint(
            self.workdir / "weights0",
            self.arch,
            id_encoded=False,
            seed=args.seed,
            dtype=getattr(torch, self.dtype),
            init="model",  # every layer shapes the greedy tokens, so the generation check can fail
            **overrides,
        )
        self.rollout_checkpoint = self._served(self.checkpoint)
        self.hostname = local_ip() if args.rollout == "sglang" else "127.0.0.1"
        self.config_fields = dict(
            protocol="tcp",
            hostname=self.hostname,
            bucket_size_mb=args.bucket_mb,
            p2p_transfer_timeout=args.transfer_timeout,
            http_timeout=args.http_timeout,
            staging=args.staging,
            executor=args.executor,
            verify_first_push=True,  # every plan generation's first push checked against SGLang's loader too
        )
        if args.fp8:  # the rollouts serve block-FP8 copies; the trainer keeps its bf16 model path
            self.config_fields["rollout_model_path"] = str(self.rollout_checkpoint)
            self.info["fp8"] = True
        self.rollout = self._rollout(f"{self.arch}-rollout", self.rollout_checkpoint, 2 * self.index)
        if not args.one_server_at_a_time:
            self.rollout.start()  # loads beside the trainer and the fresh server
            self.info["rollout_started_s"] = time.perf_counter() - t0
        self.trainer = self._trainer()
        ready = await asyncio.to_thread(self.trainer.wait_ready)
        weights1 = await asyncio.to_thread(self.trainer.call, "save", (1, str(self.workdir / "weights1")))
        weights1 = self._served(Path(weights1))
        self.fresh = self._rollout(f"{self.arch}-fresh-weights1", weights1, 2 * self.index + 1).start()
        self.info["trainer_params"] = ready["params"]
        self.info["fresh_ready_s"] = await asyncio.to_thread(self.fresh.wait_ready)
        fresh_client = SGLangClient(self.fresh.url, bootstrap_url=self.fresh.bootstrap_url, timeout=60)
        expect1 = await self._expectation(self.fresh, fresh_client)
        fresh_client.close()
        self.fresh.stop()  # frees its GPU memory; the expectation is kept
        self.info["fresh_stopped_s"] = time.perf_counter() - t0
        if args.one_server_at_a_time:
            self.rollout.start()  # only now: one SGLang server on the GPU at a time
            self.info["rollout_started_s"] = time.perf_counter() - t0
        self.info["one_server_at_a_time"] = args.one_server_at_a_time
        self.info["rollout_ready_s"] = await asyncio.to_thread(self.rollout.wait_ready)
        self.info["setup_s"] = time.perf_counter() - t0
        self.client = SGLangClient(self.rollout.url, bootstrap_url=self.rollout.bootstrap_url, timeout=60)
        self.expect = {0: await self._expectation(self.rollout, self.client), 1: expect1}
        self.info["expected_generations"] = {k: e.generation for k, e in self.expect.items()}
        require_distinct_generations(self.arch, self.expect)
        self.info["checksummed_tensors"] = len(self.expect[0].checksums)
        differing = sum(self.expect[0].checksums[k] != v for k, v in self.expect[1].checksums.items())
        self.info["tensors_differing_between_sets"] = differing
        config = P2PConfig(**self.config_fields, check_weight_update_equal=True)
        self.config = config
        adapter = P2PReplicaAdapter(0, self.rollout.url, bootstrap_url=self.rollout.bootstrap_url, config=config)
        self.lifecycle = SyncLifecycle([adapter], config, frees_kv=False)

    def _served(self, checkpoint: Path) -> Path:
        """The checkpoint a rollout starts from for these trainer weights: itself, or (--fp8) its 128x128
        block-FP8 copy written by the trainer's quantizer (what p2p writes after the same weights)."""
        if not self.args.fp8:
            return checkpoint
        from verl_p2p.trainer.fp8_checkpoint import quantize_checkpoint

        return quantize_checkpoint(checkpoint, checkpoint.with_name(checkpoint.name + "-fp8"))

    async def _expectation(self, rollout, client) -> Expectation:
        """What a rollout holding these weights answers: its checksums, and each prompt's first generation."""
        checksums = await rollout.checksums(client)
        return Expectation(
            checksums, await self._generate(rollout, client), await self._generate(rollout, client, side=True)
        )

    async def _generate(self, rollout, client, timeout: float = 60, side: bool = False) -> list[int] | None:
        return await rollout.generate(client, SIDE_PROMPT if side else PROMPT, NEW_TOKENS, timeout)

    # ---- one sync ----------------------------------------------------------------------------------------------

    def _ensure_applied(self, connection: Any, corrupt_session: bool = False) -> None:
        from verl_p2p.backend.topology import sole_source_assignment
        from verl_p2p.planning.targets import RemoteRankInfo

        sessionless = self.lifecycle.sessionless_engines()
        key = (self.trainer_instance, connection.generation, corrupt_session, sessionless)
        if self.applied == key:
            return
        assignment = sole_source_assignment(connection, sessionless)
        if corrupt_session:  # what a rollout restart leaves in a stale plan: a session nobody listens on
            infos = {t: RemoteRankInfo("127.0.0.1:1", i.params) for t, i in assignment.rank_infos.items()}
            assignment = replace(assignment, rank_infos=infos)
        self.trainer.call("apply", assignment)
        self.applied = key

    async def sync(
        self,
        weights: int,
        drill: str | None = None,
        around_push: Any = None,
        settle: Any = None,
        raw: bool = False,
    ) -> SyncRecord:
        """One sync to weight set `weights`, checked. `around_push(attempt, push)`, when given, runs each push
        attempt of the sync (1: the push, 2..: its re-pushes) and must await `push()`; `settle()` runs once the
        lifecycle returned, before the checks (the soak's faults: thaw what it froze). `raw`: the push first
        replays the previous push's write lists raw (the side-by-side figure)."""
        from verl_p2p.rollout.lifecycle import SyncError

        index = len(self.records)
        record = SyncRecord(index=index, version=str(index + 1), weights=weights, drill=drill, outcome="ok")
        record.notes["raw_replay"] = raw  # this sync's pause also holds a raw replay: not a steady-state figure
        record.notes["first_after_trainer_restart"] = bool(self.records and self.records[-1].drill == "kill")
        self.records.append(record)
        if not self.stale and self.generate_next:  # cached prefix with the weights held now (a stale one would wait)
            record.notes["generation_before"] = await self._generate(self.rollout, self.client)
        self.trainer.call("weights", weights)
        side_tasks: dict[str, asyncio.Task] = {}
        marker = self.workdir / f"stalled-{index}"

        attempts = [0]

        async def prepare(connection: Any) -> None:  # before the pause: plan, replicas, programs, first check
            await asyncio.to_thread(self._ensure_applied, connection, drill == "wrong_session")

        async def push(connection: Any) -> dict:
            attempts[0] += 1

            async def attempt() -> dict:
                await prepare(connection)  # a no-op but for a re-push's partial plan (or one re-planned in the pause)
                if drill == "paused_call":
                    side_tasks.update(await self._paused_calls(record))
                if drill == "kill":
                    return await self._killed_push(marker, record)
                return await asyncio.to_thread(self.trainer.call, "push", {"raw": raw and not connection.partial})

            return await (attempt() if around_push is None else around_push(attempts[0], attempt))

        events_before = self.rollout.event_count() if not self.rollout.generates else 0
        t0 = time.perf_counter()
        try:
            report = await self.lifecycle.sync(record.version, push, prepare=prepare)
            record.phases = {k: round(v, 4) for k, v in report.phases.items()}
            record.push = report.metrics
            record.paused_s = round(paused_seconds(report.phases), 4)
            record.notes["retried"] = [str(t) for t in report.retried_targets]
            record.notes["steps_in_pause"] = report.steps_in_pause
            if report.replanned_in_pause:
                record.notes["replanned_in_pause"] = report.replanned_in_pause
        except SyncError as exc:
            record.outcome, record.error = "failed", str(exc)
            record.notes["stale_engines"] = sorted(exc.stale_engines)
        if drill == "kill":  # what the killed push left, before anything else writes the rollout
            record.checks.append(await self._killed_mid_push(marker, weights))
        if settle is not None:
            settle()
        self.stale = record.outcome != "ok" and bool(record.notes.get("stale_engines"))
        record.notes["wall_s"] = round(time.perf_counter() - t0, 4)
        if drill == "kill":  # a new trainer process, as a restarted trainer node would come back
            self.trainer.stop()
            self.trainer = self._trainer()
            await asyncio.to_thread(self.trainer.wait_ready)
        if record.outcome == "ok":
            self.held = weights
            # what was sent while paused or stale is served first, alone: the check's generation then starts from
            # a flushed cache and shares no batch with them
            for name, task in side_tasks.items():
                await self._side_result(record, name, task, weights)
            side_tasks = {}
            await self._held_results(record, weights)
            await self._verify(record, weights)
        else:
            await self._after_failure(record)
        if not self.rollout.generates:  # the stand-in records what real SGLang would silently do wrong
            violations = self.rollout.violations(events_before)
            record.checks.append(
                Check("no_stand_in_violations", not violations, "; ".join(v["path"] for v in violations))
            )
        for name, task in side_tasks.items():
            await self._side_result(record, name, task, weights)
        return record

    async def _verify(self, record: SyncRecord, weights: int) -> None:
        expected = self.expect[weights]
        held = await self.rollout.checksums(self.client)
        differing = sorted(k for k, v in expected.checksums.items() if held.get(k) != v)
        record.checks.append(
            Check(
                "checksums_equal_fresh_rollout",
                not differing and set(held) == set(expected.checksums),
                f"{len(expected.checksums)} tensors" if not differing else f"differ: {differing[:8]}",
            )
        )
        if self.rollout.generates and self.generate_next:
            got = await self._generate(self.rollout, self.client)
            record.checks.append(
                Check(
                    "generation_equals_fresh_rollout",
                    got == expected.generation,
                    f"got {got}, fresh rollout {expected.generation}",
                )
            )

    # ---- the run -----------------------------------------------------------------------------------------------

    async def run(self) -> None:
        await self.sync(0)  # with the weights checker
        first = self.records[0]
        first.checks.insert(0, Check("weights_checker_compare", first.outcome == "ok", first.error[:300]))
        for i in range(1, self.args.syncs):
            await self.sync(i % 2)
        for _ in range(self.args.raw_syncs):  # each push beside raw Mooncake writes of its own write lists
            await self.sync(1 - self.held, raw=True)
        for drill in self.args.drills:
            target = 1 - self.held
            await self.sync(target, drill)
            await self.sync(target)  # recovery: exact weights, equal generations

    def stop(self) -> None:
        for part in ("trainer", "rollout", "fresh"):
            thing = getattr(self, part, None)
            if thing is not None:
                thing.stop()
        if getattr(self, "lifecycle", None) is not None:
            self.lifecycle.close()
        if getattr(self, "client", None) is not None:
            self.client.close()

    def report(self) -> dict[str, Any]:
        records = [asdict(r) for r in self.records]
        checks = [c for r in self.records for c in r.checks]
        drills = {}
        for r, nxt in zip(self.records, self.records[1:], strict=False):
            if r.drill:
                drills[r.drill] = {
                    "outcome": r.outcome,
                    "error": r.error[:500],
                    "checks": {c.name: c.ok for c in r.checks},
                    "notes": {k: v for k, v in r.notes.items() if k != "generation_before"},
                    "recovery_sync": {"outcome": nxt.outcome, "checks": {c.name: c.ok for c in nxt.checks}},
                }
        ok_syncs = [r for r in self.records if r.outcome == "ok" and r.push]
        gbps = [r.push.get("gbps", 0.0) for r in ok_syncs[1:]] or [r.push.get("gbps", 0.0) for r in ok_syncs]
        failures_expected = all(r.outcome == "failed" for r in self.records if r.drill in ("kill", "wrong_session"))
        return {
            **self.info,
            "passed": all(c.ok for c in checks)
            and failures_expected
            and all(r.outcome == "ok" for r in self.records if r.drill in (None, "paused_call")),
            "syncs": records,
            "drills": drills,
            "push_gbps_median": sorted(gbps)[len(gbps) // 2] if gbps else None,
            "push_bytes": ok_syncs[0].push.get("bytes") if ok_syncs else None,
            "figures": pause_and_raw_figures(self.records),
        }


async def _run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start every model's rollouts and trainer at once (a server start is minutes), then prove one model at a time."""
    import traceback

    harnesses = []
    for index, arch in enumerate(args.models):
        (workdir / arch).mkdir(parents=True, exist_ok=True)
        harnesses.append(Harness(args, arch, index, workdir / arch))
    started = await asyncio.gather(*(h.start() for h in harnesses), return_exceptions=True)
    results = {}
    for harness, start in zip(harnesses, started, strict=True):
        try:
            if isinstance(start, BaseException):
                raise start
            await harness.run()
            results[harness.arch] = harness.report()
        except Exception as exc:  # noqa: BLE001 - one model's failure is reported, the next still runs
            text = "".join(traceback.format_exception(exc))[-4000:]
            results[harness.arch] = {**harness.report(), "passed": False, "error": text}
            if hasattr(harness, "rollout"):
                results[harness.arch]["rollout_log_tail"] = harness.rollout.log_tail()
        finally:
            harness.stop()
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("verl-p2p e2e", __doc__.splitlines()[0])
    parser.add_argument(
        "--rollout",
        choices=("sglang", "loopback"),
        default="loopback",
        help="the rollout under test: real SGLang servers (GPU) or loopback engines (CPU)",
    )
    parser.add_argument(
        "--models",
        default="qwen3,qwen3_moe",
        help=f"comma list of {','.join(SIZES['tiny'])} (deepseek_v3: MLA, needs a rollout with sessions)",
    )
    parser.add_argument(
        "--size", choices=tuple(SIZES), default=None, help="model shapes (default: gpu for sglang, tiny for loopback)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="the models' depth instead of the --size shape's, for the GPU's room (default: the shape's)",
    )
    parser.add_argument(
        "--one-server-at-a-time",
        action="store_true",
        help="the fresh reference server loads, answers and stops before the rollout under test starts (the same "
        "checks, a longer set-up; what lets a model that two servers cannot share a GPU with be checked)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="trainer device (default: cuda for sglang, cpu for loopback)",
    )
    parser.add_argument("--syncs", type=int, default=3, help="plain syncs before the drills (the first is checked)")
    parser.add_argument(
        "--raw-syncs", type=int, default=1, help="syncs whose push is put beside a raw replay of its write lists"
    )
    parser.add_argument("--drills", default=",".join(DRILLS), help=f"comma list of {','.join(DRILLS)}, or none")
    parser.add_argument("--bucket-mb", type=int, default=16, help="transfer slot size in MiB (bucket_size_mb)")
    parser.add_argument(
        "--staging",
        choices=("auto", "gpu", "pinned"),
        default="auto",
        help="where the trainer's transfer slots live (docs/options.md, staging)",
    )
    parser.add_argument(
        "--executor",
        choices=("compiled", "sglang"),
        default="compiled",
        help="how HF tensors become a rank's bytes: compiled write plans, or SGLang's load_weights",
    )
    parser.add_argument("--transfer-timeout", type=float, default=20.0, help="seconds per push (p2p_transfer_timeout)")
    parser.add_argument("--http-timeout", type=float, default=30.0, help="seconds per control call (http_timeout)")
    parser.add_argument(
        "--bootstrap-port",
        type=int,
        default=26789,
        help="SGLang disaggregation bootstrap port base: rollout replica r listens on this + r",
    )
    parser.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help="SGLang --mem-fraction-static of each real server (default: computed from the GPU and the models' "
        "bytes, verl_p2p/e2e/mem_fraction.py; the loopback rollout ignores it)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the checkpoints' weights")
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="rollouts serve 128x128 block-FP8 copies of the trainer's checkpoints (needs --size gpu shapes)",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="keep the checkpoints and server logs here (default: a temporary directory, removed after)",
    )
    parser.add_argument("--out", default=None, help="write the JSON report here (default: none, no file)")
    return parser


def harness_args(**fields: Any) -> argparse.Namespace:
    """The namespace `verl-p2p e2e` parses, for a Harness built in code (the soak, cost growth): every option at its
    default with `fields` on top (lists where the command line takes comma lists). A field the e2e does not have is
    refused, so an option added here is never missing there."""
    args = build_parser().parse_args([])
    unknown = sorted(set(fields) - set(vars(args)))
    if unknown:
        raise TypeError(f"harness_args: {unknown} are not options of verl-p2p e2e")
    vars(args).update(fields)
    return args


def parse_args(argv: list[str] | None, read_gpu_bytes: Callable[[], int] | None = None) -> argparse.Namespace:
    """The e2e's options, checked and completed: defaults by rollout, and the mem fraction of its real servers
    (`args.mem_fraction`, with `args.mem_fraction_record` for the report) from `read_gpu_bytes` (default: the GPU
    at hand) unless `--mem-fraction` names one. Bad input and a run no fraction fits exit here, before anything is
    written or launched."""
    from verl_p2p.e2e.mem_fraction import MemFractionError, e2e_mem_fraction, gpu_bytes_at_hand

    parser = build_parser()
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.drills = [] if args.drills in ("", "none") else args.drills.split(",")
    unknown = [d for d in args.drills if d not in DRILLS] + [m for m in args.models if m not in SIZES["tiny"]]
    if unknown:
        parser.error(f"unknown drill/model {unknown}")
    args.size = args.size or ("gpu" if args.rollout == "sglang" else "tiny")
    unsized = [m for m in args.models if m not in SIZES[args.size]]
    if unsized:
        parser.error(f"--size {args.size} has no shape for {unsized}: use --models {','.join(SIZES[args.size])}")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers}: a model needs at least one layer")
    args.device = args.device or ("cuda" if args.rollout == "sglang" else "cpu")
    try:
        fraction = e2e_mem_fraction(args, read_gpu_bytes or gpu_bytes_at_hand)
    except MemFractionError as exc:
        parser.error(str(exc))
    args.mem_fraction, args.mem_fraction_record = fraction.value, fraction.to_dict()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if args.device == "cpu":
        from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

        install_cpu_stubs()
    command = "verl-p2p e2e " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="verl-p2p-e2e-") as tmp:
        workdir = Path(args.workdir or tmp)
        t0 = time.perf_counter()
        results = asyncio.run(_run(args, workdir))
        report = {
            "command": command,
            "rollout": args.rollout,
            "size": args.size,
            "trainer_device": args.device,
            "staging": args.staging,
            "executor": args.executor,
            "fp8": args.fp8,
            "mem_fraction": args.mem_fraction_record,
            "seconds": round(time.perf_counter() - t0, 1),
            "passed": all(r.get("passed") for r in results.values()),
            "models": results,
        }
    print(summary_text(results))
    print(f"e2e: {'PASS' if report['passed'] else 'FAIL'} ({report['seconds']} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        print(f"report: {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

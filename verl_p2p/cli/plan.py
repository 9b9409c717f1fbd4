"""`verl-p2p plan`: which trainer source writes which rollout ranks, how many bytes, and how long a sync takes.

With `--model` (a config.json, a checkpoint directory or a built-in card name) the bytes per target come from
the rollout ranks' write plans (captured on `meta` with SGLang's own model class, or read from the plan
cache), not from a formula. `--model toy` prints the abstract source -> target assignment only; without
`--model`, or with a malformed option, nothing is planned (a few lines naming the option and the fix, status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_p2p.cli import USAGE_ERROR
from verl_p2p.cli.plan_memory import DEFAULT_GPU, DEFAULT_GPU_MEM_GB, MemoryFit, candidates, refusal
from verl_p2p.cli.plan_report import (
    assumptions_text,
    estimate_json,
    gb_text,
    print_estimate,
    published_line,
    rollout_text,
    without_split_json,
)
from verl_p2p.cli.quiet import run_quietly
from verl_p2p.errors import P2PError
from verl_p2p.planning.fp8_blocks import fp8_block_problems
from verl_p2p.planning.fsdp import build_full_stream_plan
from verl_p2p.planning.hf_names import hf_tensor_specs
from verl_p2p.planning.layer_sample import LayerSample
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.planning.layout_rules import check_layouts
from verl_p2p.planning.model_cards import MODEL_CARDS, PublishedSync, card_name_of, model_card, published_for
from verl_p2p.planning.plan import SourceRank, build_transfer_plan, split_by_bytes
from verl_p2p.planning.sync_estimate import (
    DEFAULT_CONVERT_GBPS,
    DEFAULT_FP8_CONVERT_GBPS,
    DEFAULT_NIC_GBITS,
    Parallelism,
    SyncEstimate,
    estimate_sync,
    parse_parallelism,
    rollout_server_args,
    stage_params,
    trainer_sources,
)
from verl_p2p.planning.targets import TargetRank

TRAINER_KEYS = ("tp", "pp", "ep", "dp", "fsdp")
ROLLOUT_KEYS = ("tp", "ep", "dp_attn", "moe_dense_tp", "shared_tp")


TOY = "toy"  # `--model toy`: the abstract source -> target assignment, no model, no bytes
TOY_OPTIONS = ("pp", "sources_per_stage", "engines")


def _toy(args: argparse.Namespace) -> int:
    pp, per_stage, engines = toy_layout(args)
    sources = [SourceRank(global_rank=s * per_stage + i, pp_stage=s) for s in range(pp) for i in range(per_stage)]
    targets = [TargetRank(e, r) for e, n in enumerate(engines) for r in range(n)]
    print(build_transfer_plan(sources, targets).describe())
    return 0


class UsageError(ValueError):
    """Bad command-line input, found before anything heavy is imported: exit status 2."""


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def toy_layout(args: argparse.Namespace) -> tuple[int, int, list[int]]:
    """(pp, sources per stage, ranks per engine) of `--model toy`, each checked: the toy plans nothing else."""
    given = [_option(k) for k in ("trainer", "rollout") if getattr(args, k)]
    given += [f"--{k}" for k in ("anchors", "json") if getattr(args, k)]
    if given:
        raise UsageError(
            f"--model toy plans the abstract assignment of --pp, --sources-per-stage and --engines only; "
            f"{', '.join(given)} would be ignored. Fix: drop them, or give a real --model (a card: "
            f"{', '.join(MODEL_CARDS)}; a config.json or a checkpoint directory)"
        )
    pp = 1 if args.pp is None else args.pp
    per_stage = 2 if args.sources_per_stage is None else args.sources_per_stage
    for name, value in (("pp", pp), ("sources_per_stage", per_stage)):
        if value < 1:
            raise UsageError(f"{_option(name)} {value}: must be a positive integer (e.g. {_option(name)} 2)")
    text = "2,2" if args.engines is None else args.engines
    counts = [c.strip() for c in text.split(",")]
    if not text.strip() or not all(c.isdigit() and int(c) >= 1 for c in counts):
        raise UsageError(
            f"--engines {text!r}: give the ranks of each rollout engine as positive integers separated by commas "
            "(e.g. --engines 2,2 for two engines of two ranks)"
        )
    return pp, per_stage, [int(c) for c in counts]


def check_model_option(args: argparse.Namespace) -> None:
    """No plan of something the user did not name: --model is required, and the toy's options go with the toy."""
    if args.model is None or not args.model.strip():
        what = "--model is missing" if args.model is None else "--model is empty"
        raise UsageError(
            f"{what}: nothing is planned without a model. Fix: --model <card, config.json or checkpoint dir> with "
            f"--trainer and --rollout (cards: {', '.join(MODEL_CARDS)}), e.g. {EXAMPLE}; or --model toy for the "
            "abstract source -> target assignment"
        )
    stray = [_option(k) for k in TOY_OPTIONS if getattr(args, k) is not None]
    if args.model != TOY and stray:
        raise UsageError(
            f"{', '.join(stray)}: options of --model toy only, which would be ignored for --model {args.model}. Fix: "
            "drop them (the model's layouts come from --trainer tp=,pp=,ep= and --rollout tp=,ep=xN)"
        )


def check_pipeline(cfg: dict, trainer: Parallelism) -> None:
    """Megatron's even layer split, known from the config: refused before any capture, with the pp that work."""
    layers = int((cfg.get("text_config") or cfg).get("num_hidden_layers") or 0)
    if layers and layers % trainer.pp:
        choices = ", ".join(str(d) for d in range(1, layers + 1) if layers % d == 0)
        raise UsageError(
            f"--trainer pp={trainer.pp}: the model's {layers} layers do not split evenly over {trainer.pp} stages "
            f"(Megatron's default split). Fix: a pp dividing {layers}: {choices}"
        )


def check_fp8_blocks(cfg: dict, rollout: Parallelism) -> None:
    problems = fp8_block_problems(cfg, rollout)
    if problems:
        raise UsageError(
            f"--rollout {rollout.describe()}: a block-FP8 rollout of this layout cannot be built "
            "(refused before any capture):\n  - "
            + "\n  - ".join(problems)
            + "\n  (or serve bf16: --rollout-quant bf16)"
        )


def model_config(spec: str) -> tuple[str, dict, Path | None]:
    """(label, HF config, checkpoint dir or None) of a card name, a config.json or a checkpoint dir. Imports no
    torch, so a mistyped name is answered at once."""
    path = Path(spec).expanduser()
    if spec.lower() in MODEL_CARDS and not path.exists():
        return spec.lower(), model_card(spec), None
    if path.is_dir() or path.is_file():
        config_path = path / "config.json" if path.is_dir() else path
        try:
            cfg = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"--model: cannot read the model config {config_path}: {exc}") from exc
        return str(path), cfg, path if path.is_dir() else None
    raise UsageError(
        f"--model {spec!r} is neither a file, a directory nor a built-in card; give a config.json, a checkpoint "
        f"directory or one of the cards: {', '.join(MODEL_CARDS)}"
    )


def resolve_model(spec: str) -> tuple[str, dict, dict]:
    """(label, HF config, HF specs {name: (shape, torch dtype)}) of a card name, a config.json or a checkpoint dir."""
    label, cfg, checkpoint = model_config(spec)
    return label, cfg, model_specs(label, cfg, checkpoint)


def model_specs(label: str, cfg: dict, checkpoint: Path | None) -> dict:
    """HF specs {name: (shape, torch dtype)}: a checkpoint's safetensors headers, else listed from the config."""
    import torch

    if checkpoint is not None and any(checkpoint.glob("*.safetensors")):
        from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint

        return hf_specs_from_checkpoint(checkpoint)
    try:
        specs = {name: (shape, getattr(torch, dtype)) for name, shape, dtype in hf_tensor_specs(cfg)}
    except (KeyError, ValueError) as exc:
        raise UsageError(f"--model: cannot list the tensors of {label}: {exc}") from exc
    return specs


def fp8_rollout(cfg: dict, specs: dict) -> tuple[dict, dict]:
    """The model as a block-FP8 rollout serves it: the trainer's 128x128 e4m3 checkpoint (what
    `verl_p2p.trainer.fp8_checkpoint` writes). A config that is already quantized (an FP8 checkpoint dir) is kept."""
    from verl_p2p.quant.block_fp8 import BlockFp8Scheme
    from verl_p2p.trainer.fp8_checkpoint import fp8_checkpoint_model

    if cfg.get("quantization_config"):
        BlockFp8Scheme.from_hf_config(cfg)  # refuses what the quantizer cannot reproduce
        return cfg, specs
    return fp8_checkpoint_model(cfg, specs)


class Planner:
    """Write plans per rollout layout (captured or cached), shared by every estimate of one invocation.

    An estimate needs each rank's (name, bytes, feeds) only. The ranks of one layout are one SPMD program (equal
    parameter names and sizes, feeds from the same layers), so one rank is captured per layout; and a model whose
    layer kinds are known (`LayerSample`) is captured at a few layers, the others named from them (`shortcut`;
    without it every rank is captured at every layer: the check of both shortcuts, and what `rank_plan` callers
    that need whole plans get)."""

    def __init__(
        self, cfg: dict, specs: dict, cache: Any, quiet: bool = False, sample: LayerSample | None = None,
        one_rank: bool = False,
    ):  # fmt: skip
        """`sample`: cfg and specs are its short copy, planned as `sample.layers` deep; `one_rank`: capture one
        rank per layout (without either, every rank is captured at every layer)."""
        self.cfg, self.specs, self.cache, self.quiet = cfg, specs, cache, quiet
        self.sample = sample
        self.layers = sample.layers if sample is not None else int(cfg["num_hidden_layers"])
        self.one_rank = one_rank or sample is not None
        self._plans: dict[tuple, Any] = {}
        self._params: dict[str, list] = {}
        self._stages: dict[tuple[str, int], dict[int, list[tuple[str, int]]]] = {}
        self.captures: list[dict] = []
        self.refusals: set[str] = set()

    def rank_params(self, server_args: dict, rank: int) -> list[tuple[str, int, Any]]:
        """(name, bytes, feeds) of every parameter rollout rank `rank` holds, the whole model's."""
        if not self.one_rank:
            return [(p.name, p.nbytes, p.feeds) for p in self.rank_plan(server_args, rank).params.values()]
        key = json.dumps(server_args, sort_keys=True)
        if key not in self._params:
            plan = self.rank_plan(server_args, 0)
            params = [(p.name, p.nbytes, p.feeds) for p in plan.params.values()]
            self._params[key] = self.sample.expand(params) if self.sample is not None else params
        return self._params[key]

    def server_args_of(self, rollout: Parallelism) -> dict:
        server_args = rollout_server_args(rollout, dtype=str(self.cfg.get("torch_dtype") or "bfloat16"))
        if not _has_cuda():  # some model classes (yarn rope) ask the device; the plan's bytes do not depend on it
            server_args["device"] = "cpu"
        return server_args

    def rank_bytes(self, rollout: Parallelism) -> int:
        """The largest rank's bytes of a rollout layout (from its write plans)."""
        server_args = self.server_args_of(rollout)
        ranks = [0] if self.one_rank else range(rollout.tp)
        return max(sum(n for _, n, _ in self.rank_params(server_args, r)) for r in ranks)

    def rank_stages(self, server_args: dict, rank: int, pp: int) -> dict[int, list[tuple[str, int]]]:
        """`stage_params` of one rank: computed once per layout and pp where one rank stands for all."""
        if not self.one_rank:
            return stage_params(self.rank_params(server_args, rank), self.layers, pp)
        key = (json.dumps(server_args, sort_keys=True), pp)
        if key not in self._stages:
            self._stages[key] = stage_params(self.rank_params(server_args, rank), self.layers, pp)
        return self._stages[key]

    def _log(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)

    def rank_plan(self, server_args: dict, rank: int) -> Any:
        from verl_p2p.replica.stream import plan_rank

        layout = layout_from_server_args(server_args, rank)
        key = (json.dumps(server_args, sort_keys=True), layout.key)
        if key not in self._plans:
            if not self.captures:
                self._log(
                    "[plan] write plans: read from the plan cache, else captured (SGLang's own model class built on "
                    "the meta device, so no memory is used; the first capture also imports SGLang)"
                )
            t0 = time.perf_counter()
            planned = plan_rank(self.cfg, server_args, layout, self.specs, self.cache)
            seconds = time.perf_counter() - t0
            how = "from the plan cache" if planned.from_cache else "captured"
            self._log(f"  rollout rank {rank} of {rollout_text(server_args)}: plan {how} in {seconds:.2f} s")
            self.captures.append(
                {"rank": rank, "server_args": server_args, "seconds": seconds, "cached": planned.from_cache}
            )
            if planned.plan.derived:
                from verl_p2p.replica.plan import WritePlanError, check_syncable

                try:
                    check_syncable(planned.plan)
                except WritePlanError as exc:
                    self.refusals.add(str(exc))
            self._plans[key] = planned.plan
        return self._plans[key]

    def estimate(
        self,
        trainer: Parallelism,
        rollout: Parallelism,
        nic_gbits: float,
        convert_gbps: float,
        slot_bytes: int,
        split: bool = True,
        rollout_nic: float | None = None,
    ) -> tuple[SyncEstimate, dict]:
        """The estimate of one layout pair; `split`: several sources per target where a stage has more ranks
        than there are targets (what p2p does), else one (idle ranks)."""
        server_args = self.server_args_of(rollout)
        sources = trainer_sources(trainer)  # an FSDP trainer: every rank, one stage (it streams the whole model)
        named, keys = {}, {}
        for r in range(rollout.tp):
            named[r] = self.rank_stages(server_args, r, trainer.pp)
            keys[r] = layout_from_server_args(server_args, r).key
        per_rank = {r: {s: sum(n for _, n in ps) for s, ps in by.items()} for r, by in named.items()}
        targets = [TargetRank(e, r) for e in range(rollout.engines) for r in range(rollout.tp)]
        layout_keys = {t: keys[t.rank] for t in targets}
        if trainer.fsdp is not None and split:  # every FSDP rank writes its part of every target
            transfer = build_full_stream_plan(sources, targets)
        else:
            transfer = build_transfer_plan(sources, targets, layout_keys, split=split)
        parts: dict[tuple[int, int, int], list[int]] = {}

        def part_bytes(t: TargetRank, stage: int, index: int, count: int) -> int:
            key = (t.rank, stage, count)
            if key not in parts:
                sizes = dict(named[t.rank][stage])
                parts[key] = [sum(sizes[n] for n in p) for p in split_by_bytes(sizes.items(), count)]
            return parts[key][index]

        estimate = estimate_sync(
            transfer,
            {t: per_rank[t.rank] for t in targets},
            layout_keys,
            nic_gbits,
            convert_gbps,
            slot_bytes,
            part_bytes=part_bytes,
            rollout_nic_gbits=rollout_nic,
        )
        return estimate, server_args


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


EXAMPLE = "verl-p2p plan --model qwen3-30b-a3b --trainer tp=4,ep=8 --rollout tp=8,ep=8x4"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-p2p plan",
        description="Source -> target assignment, bytes per link and a predicted sync time (from write plans). "
        f"Pass --model with --trainer and --rollout, e.g. {EXAMPLE}; or --model alone for a built-in card's "
        "published layouts.",
    )
    parser.add_argument("--model", help=f"config.json, checkpoint dir, or a card: {', '.join(MODEL_CARDS)}")
    parser.add_argument(
        "--trainer",
        help="trainer layout: tp=4,pp=2,ep=8 (optional dp=) for Megatron, or fsdp=N for an FSDP trainer of N ranks",
    )
    parser.add_argument(
        "--rollout",
        help="rollout layout and replicas, e.g. tp=8,ep=8,dp_attn=8x4; moe_dense_tp=1 (--moe-dense-tp-size 1) and "
        "shared_tp=1 (SGLANG_SHARED_EXPERT_TP1=1) keep the dense MLP / shared expert whole on every rank",
    )
    parser.add_argument("--nic-gbps", type=float, default=DEFAULT_NIC_GBITS, help="NIC per trainer GPU, Gb/s")
    parser.add_argument(
        "--rollout-nic-gbps", type=float, default=None, help="NIC per rollout GPU, Gb/s (default: --nic-gbps)"
    )
    parser.add_argument("--convert-gbps", type=float, default=None, help="conversion throughput per source, GB/s")
    parser.add_argument("--bucket-mb", type=int, default=512, help="transfer slot size (bucket_size_mb)")
    parser.add_argument(
        "--gpu-mem",
        type=float,
        default=DEFAULT_GPU_MEM_GB,
        help=f"GB of one GPU (default {DEFAULT_GPU_MEM_GB:g}: an {DEFAULT_GPU}; 141 for an H200): a layout whose "
        "rollout rank weights or trainer staging exceed it is refused, with the nearest layouts that fit",
    )
    parser.add_argument("--anchors", action="store_true", help="predict at the published figures' layouts")
    parser.add_argument("--plan-cache-dir", default=None, help="plan cache directory ('' disables)")
    parser.add_argument(
        "--rollout-quant",
        choices=("bf16", "fp8"),
        default="bf16",
        help="what the rollout serves: the trainer's dtype (bf16) or its 128x128 block-FP8 checkpoint (fp8)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--every-rank",
        action="store_true",
        help="capture every rollout rank at every layer (slow) instead of one rank per layout and one layer per "
        "kind; the same figures (the check of the shortcut)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show third-party output instead of logging it")
    parser.add_argument(
        "--link",
        default=None,
        help="how bytes travel for the whole-sync prediction: tcp-one-host (Mooncake tcp through one host) or "
        "rdma:N (N Gb/s per GPU; default rdma at --nic-gbps)",
    )
    parser.add_argument(
        "--check-measured",
        action="store_true",
        help="re-predict every committed GPU run (docs/measurements/measured_runs.json), print predicted vs "
        "measured, status 1 when a held-out run is outside +-25%%",
    )
    parser.add_argument("--measured-runs", default=None, help="(--check-measured) another runs file")
    parser.add_argument("--table", default=None, help="(--check-measured) also write the table to this file")
    parser.add_argument("--sources-per-stage", type=int, default=None, help="(--model toy) sources per stage (2)")
    parser.add_argument("--pp", type=int, default=None, help="(--model toy) pipeline stages (1)")
    parser.add_argument("--engines", default=None, help="(--model toy) ranks per rollout engine (2,2)")
    return parser


@dataclass(frozen=True)
class PlanRequest:
    """What one `verl-p2p plan --model` run plans, checked before torch or SGLang is imported."""

    label: str
    cfg: dict
    checkpoint: Path | None
    card: str | None
    published: list[PublishedSync]
    anchors: bool
    trainer: Parallelism | None
    rollout: Parallelism | None
    convert_gbps: float
    rollout_nic: float
    slot_bytes: int


def run(argv: list[str]) -> int:
    parser = build_parser()
    if not argv:
        print(f"verl-p2p plan: give --model (and --trainer, --rollout), e.g. {EXAMPLE}\n", file=sys.stderr)
        parser.print_help(sys.stderr)
        return USAGE_ERROR
    args = parser.parse_args(argv)
    if args.check_measured:
        from verl_p2p.cli.plan_check import run_check

        try:
            return run_check(args.measured_runs, args.table)
        except (OSError, ValueError, KeyError) as exc:
            print(f"verl-p2p plan --check-measured: {exc}", file=sys.stderr)
            return USAGE_ERROR
    try:
        if args.link is not None:
            from verl_p2p.planning.whole_sync import parse_link

            link = parse_link(args.link)
            if link.kind == "rdma":
                args.nic_gbps = link.gbits
        check_model_option(args)
        if args.model == TOY:
            return _toy(args)
        request = check_request(args)
    except (ValueError, P2PError) as exc:
        print(f"verl-p2p plan: {exc}", file=sys.stderr)
        return USAGE_ERROR
    return run_quietly("plan", args.verbose, lambda: _refused_or(lambda: _run(args, request)), notice_on_stderr=True)


def _refused_or(body: Callable[[], int]) -> int:
    """A model or layout p2p refuses once its tensors are known (FP8 block rules, say): one line, status 2."""
    try:
        return body()
    except (ValueError, P2PError) as exc:
        print(f"verl-p2p plan: {exc}", file=sys.stderr)
        return USAGE_ERROR


def check_request(args: argparse.Namespace) -> PlanRequest:
    """Every check that needs no tensors: the model found, the layouts parsed and buildable by SGLang and
    Megatron, the numbers positive (UsageError naming the option)."""
    try:
        trainer = parse_parallelism(args.trainer, TRAINER_KEYS) if args.trainer else None
        rollout = parse_parallelism(args.rollout, ROLLOUT_KEYS) if args.rollout else None
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    label, cfg, checkpoint = model_config(args.model)
    card = card_name_of(cfg)
    published = published_for(card) if card else []
    anchors = args.anchors or (trainer is None and rollout is None and bool(published))
    if not anchors and (trainer is None or rollout is None):
        raise UsageError("give --trainer and --rollout (or --anchors for a built-in card with published figures)")
    if anchors and not published:
        raise UsageError(f"no published figures for {label}; give --trainer and --rollout")
    fp8 = args.rollout_quant == "fp8"
    measured = DEFAULT_FP8_CONVERT_GBPS if fp8 else DEFAULT_CONVERT_GBPS
    convert_gbps = args.convert_gbps if args.convert_gbps is not None else measured
    rollout_nic = args.rollout_nic_gbps if args.rollout_nic_gbps is not None else args.nic_gbps
    if args.nic_gbps <= 0 or rollout_nic <= 0 or convert_gbps <= 0 or args.bucket_mb <= 0 or args.gpu_mem <= 0:
        raise UsageError("--nic-gbps, --rollout-nic-gbps, --convert-gbps, --bucket-mb and --gpu-mem must be positive")
    pairs = [(p.trainer, p.rollout) for p in published] if anchors else [(trainer, rollout)]
    for t, r in pairs:
        try:
            trainer_sources(t)
            rollout_server_args(r)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        check_layouts(cfg, t, [r])
        check_pipeline(cfg, t)
        if fp8 or cfg.get("quantization_config"):
            check_fp8_blocks(cfg, r)
    return PlanRequest(
        label, cfg, checkpoint, card, published, anchors, trainer, rollout, convert_gbps, rollout_nic,
        args.bucket_mb << 20,
    )  # fmt: skip


def _cache_text(cache: Any) -> str:
    """Where the plan cache lives and how much it holds."""
    if cache is None:
        return "plan cache: off (--plan-cache-dir '')"
    files = [f for f in cache.directory.glob("plan-*.json") if f.is_file()] if cache.directory.is_dir() else []
    size = sum(f.stat().st_size for f in files)
    moves = "--plan-cache-dir moves it, '' turns it off"
    return f"plan cache: {cache.directory} ({len(files)} plans, {gb_text(size)}; {moves})"


def _run(args: argparse.Namespace, request: PlanRequest) -> int:
    trainer, rollout, published, anchors = request.trainer, request.rollout, request.published, request.anchors
    label, cfg = request.label, request.cfg
    hf_cfg = cfg
    hf_specs = model_specs(label, cfg, request.checkpoint)
    fp8 = args.rollout_quant == "fp8"
    # the shortcut: a few layers captured (one rank per layout), the rest named; --every-rank captures it all
    sample = None if args.every_rank else LayerSample.of(cfg)
    if sample is not None and not sample.covers(hf_specs):
        sample = None
    specs = sample.specs(hf_specs) if sample is not None else hf_specs
    cfg = sample.config(cfg) if sample is not None else cfg
    if fp8:
        cfg, specs = fp8_rollout(cfg, specs)
    rollout_bytes = sum(_numel(s) * d.itemsize for s, d in specs.values())
    if sample is not None:
        rollout_bytes = sample.whole_bytes({n: _numel(s) * d.itemsize for n, (s, d) in specs.items()})
    convert_gbps, rollout_nic, slot_bytes = request.convert_gbps, request.rollout_nic, request.slot_bytes

    from verl_p2p.replica.plan_cache import PlanCache
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()  # SGLang's model classes import GPU kernels at import time; only captures need them
    cache = PlanCache.from_option(args.plan_cache_dir)
    planner = Planner(cfg, specs, cache, quiet=args.json, sample=sample, one_rank=not args.every_rank)
    planner._log(f"[plan] {_cache_text(cache)}")
    fsdp = trainer is not None and trainer.fsdp is not None
    assumptions = assumptions_text(
        args.nic_gbps, convert_gbps, args.convert_gbps is not None, slot_bytes, fp8, rollout_nic, fsdp
    )

    def estimates(trainer: Parallelism, rollout: Parallelism) -> tuple[SyncEstimate, SyncEstimate]:
        """This layout pair with the split (what p2p does) and without it (one source per target and stage)."""
        network = (args.nic_gbps, convert_gbps, slot_bytes)
        est, _ = planner.estimate(trainer, rollout, *network, rollout_nic=rollout_nic)
        unsplit, _ = planner.estimate(trainer, rollout, *network, split=False, rollout_nic=rollout_nic)
        return est, unsplit

    gpu_bytes = int(args.gpu_mem * 1e9)
    gpu = DEFAULT_GPU if args.gpu_mem == DEFAULT_GPU_MEM_GB else f"{args.gpu_mem:g} GB"

    def fit_of(est: SyncEstimate) -> MemoryFit:
        return MemoryFit(gpu_bytes, max(est.target_bytes.values(), default=0), 2 * slot_bytes)

    out: dict[str, Any] = {
        "model": label,
        "card": request.card,
        "num_hidden_layers": hf_cfg.get("num_hidden_layers"),
        "hf_tensors": len(hf_specs),
        "hf_bytes": sum(_numel(s) * d.itemsize for s, d in hf_specs.values()),
        "rollout_quant": args.rollout_quant,
        "rollout_bytes": rollout_bytes,
        "nic_gbps": args.nic_gbps,
        "rollout_nic_gbps": rollout_nic,
        "convert_gbps": convert_gbps,
        "assumptions": assumptions,
    }
    if anchors:
        rows = []
        for p in published:
            est, unsplit = estimates(p.trainer, p.rollout)
            link, whole = _whole_sync(args, est, p.trainer, p.rollout, len(hf_specs), fp8)
            rows.append(
                {
                    "system": p.system,
                    "published": p.figure(),
                    "published_s": list(p.seconds),
                    "setting": p.setting,
                    "assumed": p.assumed,
                    **estimate_json(est, p.trainer, p.rollout),
                    **without_split_json(unsplit),
                    "memory": fit_of(est).json(),
                    "whole_sync": {"link": link, **whole.json()},
                }
            )
        out["anchors"] = rows
    else:
        est, unsplit = estimates(trainer, rollout)
        fit = fit_of(est)
        if not fit.fits:
            nearest = []
            for c in candidates(hf_cfg, rollout):
                if fp8 and fp8_block_problems(hf_cfg, c):
                    continue
                nearest.append((c, planner.rank_bytes(c)))
                if sum(n <= gpu_bytes for _, n in nearest) >= 2:
                    break
            print(f"verl-p2p plan: {refusal(fit, rollout, gpu, nearest, gb_text)}", file=sys.stderr)
            return USAGE_ERROR
        out["memory"] = fit.json()
        out.update(estimate_json(est, trainer, rollout))
        whole = _whole_sync(args, est, trainer, rollout, len(hf_specs), fp8)
        out["whole_sync"] = {"link": whole[0], **whole[1].json()}
        out.update(without_split_json(unsplit))
        out["published"] = [{"system": p.system, "published": p.figure(), "setting": p.setting} for p in published]
    out["plans"] = planner.captures
    out["refused"] = sorted(planner.refusals)
    captured = [c for c in planner.captures if not c["cached"]]
    if captured:
        planner._log(
            f"[plan] {len(captured)} of {len(planner.captures)} write plans captured in "
            f"{sum(c['seconds'] for c in captured):.1f} s; {_cache_text(cache)}"
        )
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    print(f"model {label}: {out['hf_tensors']} HF tensors, {gb_text(out['hf_bytes'])}", end="")
    print(f"; the rollout holds {gb_text(out['rollout_bytes'])} ({args.rollout_quant})")
    if anchors:
        print(
            f"{'system':<24} {'published':>10} {'predicted':>10} {'wire floor':>10} {'no split':>10} {'whole':>10}  "
            "trainer -> rollout (assumed)"
        )
        for row in out["anchors"]:
            whole_row = row["whole_sync"]
            print(
                f"{row['system']:<24} {row['published']:>10} {row['predicted_s']:>9.3f}s {row['wire_floor_s']:>9.3f}s"
                f" {row['predicted_without_split_s']:>9.3f}s {whole_row['steady_paused_s']:>9.3f}s  "
                f"{row['trainer']['layout']} -> {row['rollout']['layout']} ({row['senders']} of "
                f"{row['trainer']['ranks']} trainer GPUs send; wire {row['bound']}-bound; whole sync "
                f"{whole_row['bound']}-bound)"
            )
        print(
            "predicted: the wire through the layout's links; whole: the steady pause with export, conversion, "
            f"staging, control plane and p2p's fixed cost added (link {out['anchors'][0]['whole_sync']['link']})"
        )
        for row in out["anchors"]:
            print(f"  {row['system']} {row['published']}: {row['setting']}; assumed: {row['assumed']}")
            if not row["memory"]["fits"]:
                print(
                    f"    does not fit one {gpu} GPU: a rollout rank holds "
                    f"{gb_text(row['memory']['rollout_rank_bytes'])} (--gpu-mem)"
                )
    else:
        print_estimate(est, trainer, rollout, unsplit)
        print(f"{whole[1].text()} [link {whole[0]}]")
        tight = " (tight: little room for the KV cache)" if fit.tight else ""
        print(
            f"memory: a rollout rank holds {gb_text(fit.rollout_rank_bytes)} of weights, a trainer source stages "
            f"{gb_text(fit.staging_bytes)}; fits one {gpu} GPU{tight}"
        )
        for p in published:
            print(f"published for this model: {published_line(p)}")
    print("assumptions: " + "; ".join(f"{k}: {v}" for k, v in assumptions.items()))
    for reason in out["refused"]:
        print(f"WARNING: p2p refuses this model: {reason}")
    return 0


def _whole_sync(
    args: argparse.Namespace, est: SyncEstimate, trainer: Parallelism, rollout: Parallelism, hf_tensors: int, fp8: bool
) -> tuple[str, Any]:
    """The whole sync of the slowest source (export, conversion, staging, wire, control plane, pause)."""
    from verl_p2p.cli.plan_rates_file import load_rates
    from verl_p2p.planning.whole_sync import Link, parse_link, predict_whole

    link = parse_link(args.link) if args.link else Link("rdma", args.nic_gbps)
    slow = est.slowest
    per_source = -(-hf_tensors // (trainer.pp * (1 if trainer.fsdp is not None else trainer.tp)))
    whole = predict_whole(
        load_rates(), slow.wire_bytes, per_source, link, "fsdp" if trainer.fsdp is not None else "megatron", fp8,
        rollout.engines, layout_wire_s=est.predicted_s if link.kind == "rdma" else None,
    )  # fmt: skip
    return link.describe(), whole


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main(argv: list[str] | None = None) -> int:
    return run(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())

"""What one sync moves and how long it should take, from the bytes each rollout rank holds (pure arithmetic).

The bytes come from the rollout ranks' write plans (the caller captures or loads them). Per trainer pipeline
stage, every rollout rank gets one sender, or several each writing one part of its parameters when the stage
has more ranks than there are targets (`build_transfer_plan`); a sender converts the bytes of each distinct
(rank layout, part) it serves once and writes them to every target holding that layout. The estimate:

- wire: a source's bytes over its NIC (one NIC per trainer GPU);
- receive: a target rank's bytes over its own NIC (one NIC per rollout GPU): however many sources split a
  rank, its bytes arrive through one NIC, so several senders per rank pay off only where that NIC is faster
  than a sender's, or the senders are slowed by conversion or by writing several targets;
- convert: the bytes a source produces (once per distinct layout) at the conversion throughput;
- predicted per source: max(convert, wire) plus one transfer slot of the other (two slots pipeline
  conversion into one while the other is on the wire); the sync's prediction is the slowest source's, or the
  slowest target's receive time where that is longer. The wire floor is the larger of the two wire bounds.

Not counted: the trainer's HF export (Megatron all-gathers) and the rollout's pause/resume round trips.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from verl_p2p.planning.hf_names import pp_stage_of
from verl_p2p.planning.plan import SourceRank, TransferPlan
from verl_p2p.planning.shared_experts import SHARED_TP1
from verl_p2p.planning.targets import TargetRank

# Conversion throughput per source assumed when none is given: the compiled executor into GPU transfer slots on
# an H200 (what a source over RDMA uses), measured by `verl-p2p bench --device cuda --model qwen3-30b-a3b --layers 4`
# (docs/measurements/bench_convert_h200_qwen3_30b_a3b_tp2ep2.json, which also has the pinned-slot figure).
DEFAULT_CONVERT_GBPS = 1004.6
_CONVERT_JSON = "docs/measurements/bench_convert_h200_qwen3_30b_a3b_tp2ep2.json"
DEFAULT_CONVERT_SOURCE = f"compiled executor into GPU slots on an H200, 1004.6 GB/s ({_CONVERT_JSON})"
# FP8 targets: the same executor with the quantize step (the one-launch Triton quantizer); its JSON has the bf16
# figure of the same run beside it
DEFAULT_FP8_CONVERT_GBPS = 215.1
DEFAULT_FP8_CONVERT_SOURCE = (
    "compiled executor with the quantize step into GPU slots on an H200, 215.1 GB/s of FP8 bytes "
    "(docs/measurements/bench_convert_fp8_h200_qwen3_30b_a3b_tp2ep2_s12.json)"
)
DEFAULT_NIC_GBITS = 400.0


@dataclass(frozen=True)
class Parallelism:
    """A trainer or rollout layout as the CLI spells it (`tp=4,pp=2,ep=8`, `tp=8,ep=8,dp_attn=8x4`)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int | None = None  # trainer data parallel; None: the smallest that holds ep (Megatron folds EP into DP x TP)
    dp_attn: int = 1  # rollout attention data parallelism (SGLang --enable-dp-attention --dp-size)
    moe_dense_tp: int | None = None  # rollout dense MLP TP size (SGLang --moe-dense-tp-size; 1 or unset)
    shared_tp: int | None = None  # rollout shared-expert TP size (1: SGLANG_SHARED_EXPERT_TP1=1; or unset)
    engines: int = 1  # rollout replicas
    fsdp: int | None = None  # an FSDP trainer of this many ranks: each streams the whole model (`planning.fsdp`)

    def describe(self) -> str:
        if self.fsdp is not None:
            return f"fsdp={self.fsdp}"
        parts = [f"tp={self.tp}"]
        if self.pp != 1:
            parts.append(f"pp={self.pp}")
        parts.append(f"ep={self.ep}")
        if self.dp is not None:
            parts.append(f"dp={self.dp}")
        if self.dp_attn != 1:
            parts.append(f"dp_attn={self.dp_attn}")
        parts += [f"{k}={v}" for k, v in (("moe_dense_tp", self.moe_dense_tp), ("shared_tp", self.shared_tp)) if v]
        return ",".join(parts) + (f"x{self.engines}" if self.engines != 1 else "")

    @property
    def trainer_dp(self) -> int:
        if self.fsdp is not None:
            return self.fsdp
        return self.dp if self.dp is not None else math.lcm(self.tp, self.ep) // self.tp

    @property
    def trainer_ranks(self) -> int:
        return self.tp * self.pp * self.trainer_dp


def parse_parallelism(text: str, allowed: Sequence[str]) -> Parallelism:
    """`"tp=8,ep=8,dp_attn=8x4"` -> Parallelism; `xN` (rollout) is the number of replicas."""
    body, engines = text.strip(), 1
    if "x" in body.rsplit(",", 1)[-1]:
        body, _, count = body.rpartition("x")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"{text!r}: the replica count after 'x' must be a positive integer")
        engines = int(count)
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in allowed:
            raise ValueError(f"{text!r}: {part!r} is not one of {', '.join(f'{a}=N' for a in allowed)}")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{text!r}: {name} must be a positive integer, got {value!r}")
        values[name] = int(value)
    return Parallelism(engines=engines, **values)


def check_trainer(par: Parallelism) -> None:
    if par.fsdp is not None and (par.tp, par.pp, par.ep, par.dp) != (1, 1, 1, None):
        raise ValueError(f"trainer fsdp={par.fsdp} stands alone: an FSDP trainer has no tp, pp, ep or dp to give")
    dp = par.trainer_dp
    if (par.tp * dp) % par.ep:
        raise ValueError(f"trainer ep={par.ep} does not divide the {par.tp * dp} ranks of a stage (tp x dp)")


def trainer_sources(par: Parallelism) -> list[SourceRank]:
    """Every trainer rank, stage by stage: after the in-stage gather each holds its stage's weights."""
    check_trainer(par)
    per_stage = par.tp * par.trainer_dp
    return [SourceRank(global_rank=s * per_stage + i, pp_stage=s) for s in range(par.pp) for i in range(per_stage)]


def rollout_server_args(par: Parallelism, dtype: str = "bfloat16") -> dict:
    """The SGLang server args of one rollout replica of this layout (what /server_info would report)."""
    if par.tp % par.ep or par.tp % par.dp_attn:
        raise ValueError(f"rollout tp={par.tp} must be divisible by ep={par.ep} and dp_attn={par.dp_attn}")
    for key, value in (("moe_dense_tp", par.moe_dense_tp), ("shared_tp", par.shared_tp)):
        if value not in (None, 1):
            raise ValueError(f"rollout {key}={value}: SGLang takes 1 (unsharded on every rank) or leaves it unset")
    args = {"tp_size": par.tp, "ep_size": par.ep, "dtype": dtype}
    if par.dp_attn > 1:
        args.update(dp_size=par.dp_attn, enable_dp_attention=True)
    if par.moe_dense_tp == 1:
        args["moe_dense_tp_size"] = 1
    if par.shared_tp == 1:  # an environment setting of the rollout, carried as p2p reads it from published sizes
        args[SHARED_TP1] = True
    return args


def stage_params(
    params: Iterable[tuple[str, int, Sequence[str]]], num_layers: int, pp: int
) -> dict[int, list[tuple[str, int]]]:
    """(name, nbytes) of one rollout rank's parameters per trainer stage: a parameter belongs to the stage
    exporting its feeds (feedless padding fills to stage 0); `params` is (name, nbytes, feeds)."""
    out: dict[int, list[tuple[str, int]]] = {s: [] for s in range(pp)}
    for name, nbytes, feeds in params:
        stages = {pp_stage_of(f, num_layers, pp) for f in feeds} or {0}
        if len(stages) > 1:
            raise ValueError(f"rollout parameter {name} is fed by HF tensors of stages {sorted(stages)}")
        out[stages.pop()].append((name, int(nbytes)))
    return out


def stage_bytes(params: Iterable[tuple[str, int, Sequence[str]]], num_layers: int, pp: int) -> dict[int, int]:
    """Bytes of one rollout rank each trainer stage writes (see `stage_params`)."""
    return {s: sum(n for _, n in named) for s, named in stage_params(params, num_layers, pp).items()}


@dataclass(frozen=True)
class SourceEstimate:
    rank: int
    pp_stage: int
    links: tuple[tuple[TargetRank, int], ...]  # (target, bytes) this source writes
    convert_bytes: int
    wire_s: float
    convert_s: float
    predicted_s: float
    parts: tuple[tuple[int, int], ...] = ()  # (part index, count) per link; (0, 1): the whole target

    @property
    def wire_bytes(self) -> int:
        return sum(n for _, n in self.links)


@dataclass(frozen=True)
class SyncEstimate:
    sources: tuple[SourceEstimate, ...]
    nic_gbits: float
    convert_gbps: float
    slot_bytes: int
    target_bytes: Mapping[TargetRank, int] = field(default_factory=dict)
    rollout_nic_gbits: float | None = None  # one NIC per rollout GPU; None: as fast as a trainer GPU's

    @property
    def senders(self) -> list[SourceEstimate]:
        return [s for s in self.sources if s.links]

    @property
    def slowest(self) -> SourceEstimate:
        return max(self.senders, key=lambda s: (s.predicted_s, s.wire_s, -s.rank))

    @property
    def send_floor_s(self) -> float:
        """The slowest source's bytes over its NIC."""
        return max(s.wire_s for s in self.senders)

    @property
    def receive_gbits(self) -> float:
        """A rollout GPU's NIC, Gb/s."""
        return self.rollout_nic_gbits or self.nic_gbits

    @property
    def receive_floor_s(self) -> float:
        """The largest target rank's bytes over its own NIC (all its senders share it)."""
        return max(self.target_bytes.values(), default=0) / (self.receive_gbits * 1e9 / 8)

    @property
    def wire_floor_s(self) -> float:
        """No sync of this plan can be faster on this network: the larger of the send and receive bounds."""
        return max(self.send_floor_s, self.receive_floor_s)

    @property
    def bound(self) -> str:
        """What decides the prediction: `receive` (a target's NIC), `send` (a source's NIC) or `convert`."""
        if self.receive_floor_s > self.slowest.predicted_s:
            return "receive"
        return "send" if self.slowest.wire_s >= self.slowest.convert_s else "convert"

    @property
    def predicted_s(self) -> float:
        return max(self.slowest.predicted_s, self.receive_floor_s)

    @property
    def total_bytes(self) -> int:
        return sum(s.wire_bytes for s in self.sources)


PartBytes = Callable[[TargetRank, int, int, int], int]  # (target, stage, part index, part count) -> bytes


def estimate_sync(
    transfer: TransferPlan,
    bytes_by_stage: Mapping[TargetRank, Mapping[int, int]],
    layout_keys: Mapping[TargetRank, Hashable],
    nic_gbits: float = DEFAULT_NIC_GBITS,
    convert_gbps: float = DEFAULT_CONVERT_GBPS,
    slot_bytes: int = 512 << 20,
    part_bytes: PartBytes | None = None,
    rollout_nic_gbits: float | None = None,
) -> SyncEstimate:
    """Per-source wire and conversion time of `transfer`; `bytes_by_stage[target][stage]` from the plans.
    `part_bytes`: the bytes of one part of a split target (from its parameters, `split_by_bytes`); without it
    a part counts as an even share. `rollout_nic_gbits`: a rollout GPU's NIC (None: `nic_gbits`)."""
    if (
        nic_gbits <= 0
        or convert_gbps <= 0
        or slot_bytes <= 0
        or (rollout_nic_gbits is not None and rollout_nic_gbits <= 0)
    ):
        raise ValueError("NIC bandwidths, conversion throughput and slot size must be positive")
    nic_bps, convert_bps = nic_gbits * 1e9 / 8, convert_gbps * 1e9
    sources = []
    for rank in sorted(transfer.tasks):
        stage = transfer.stages[rank]
        links, produced = [], {}
        parts = tuple(transfer.part_of(rank, t) for t in transfer.tasks[rank])
        for t, (index, count) in zip(transfer.tasks[rank], parts, strict=True):
            whole = bytes_by_stage[t][stage]
            if count == 1:
                n = whole
            else:
                n = part_bytes(t, stage, index, count) if part_bytes else -(-whole // count)
            links.append((t, n))
            produced[(layout_keys[t], index, count)] = n
        links = tuple(links)
        convert_bytes = sum(produced.values())
        wire_s = sum(n for _, n in links) / nic_bps
        convert_s = convert_bytes / convert_bps
        one_slot = min(slot_bytes / nic_bps, slot_bytes / convert_bps, min(wire_s, convert_s))
        predicted = max(wire_s, convert_s) + one_slot if links else 0.0
        sources.append(SourceEstimate(rank, stage, links, convert_bytes, wire_s, convert_s, predicted, parts))
    totals = {t: sum(by.values()) for t, by in bytes_by_stage.items()}
    return SyncEstimate(tuple(sources), nic_gbits, convert_gbps, slot_bytes, totals, rollout_nic_gbits)

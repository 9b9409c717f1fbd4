"""What `verl-p2p plan` prints: an estimate as JSON and as text, the assumptions it rests on, the published
figures beside it. Kept apart from the command (`plan.py`: arguments, checks, captures) so each has one job.
"""

from __future__ import annotations

from verl_p2p.cli.plan_table import HEADER, source_lines
from verl_p2p.planning.model_cards import PublishedSync
from verl_p2p.planning.shared_experts import SHARED_TP1
from verl_p2p.planning.sync_estimate import (
    DEFAULT_CONVERT_SOURCE,
    DEFAULT_FP8_CONVERT_SOURCE,
    Parallelism,
    SyncEstimate,
)


def rollout_text(server_args: dict) -> str:
    text = f"tp={server_args['tp_size']},ep={server_args['ep_size']}"
    text += f",dp_attn={server_args['dp_size']}" if server_args.get("enable_dp_attention") else ""
    text += ",moe_dense_tp=1" if server_args.get("moe_dense_tp_size") == 1 else ""
    return text + (",shared_tp=1" if server_args.get(SHARED_TP1) else "")


def gb_text(n: int) -> str:
    """Bytes for people: GB (1e9) from 0.1 GB up, else MB or kB."""
    if n >= 1e8:
        return f"{n / 1e9:.2f}GB"
    return f"{n / 1e6:.2f}MB" if n >= 1e5 else f"{n / 1e3:.1f}kB"


def estimate_json(est: SyncEstimate, trainer: Parallelism, rollout: Parallelism) -> dict:
    return {
        "trainer": {
            "layout": trainer.describe(),
            "tp": trainer.tp,
            "pp": trainer.pp,
            "ep": trainer.ep,
            "dp": trainer.trainer_dp,
            "ranks": trainer.trainer_ranks,
        },
        "rollout": {
            "layout": rollout.describe(),
            "tp": rollout.tp,
            "ep": rollout.ep,
            "dp_attn": rollout.dp_attn,
            "moe_dense_tp": rollout.moe_dense_tp,
            "shared_tp": rollout.shared_tp,
            "engines": rollout.engines,
        },
        "target_bytes": {f"e{t.engine}r{t.rank}": n for t, n in sorted(est.target_bytes.items())},
        "links": [
            {
                "source": s.rank,
                "pp_stage": s.pp_stage,
                "engine": t.engine,
                "rank": t.rank,
                "bytes": n,
                **({"part": [i + 1, k]} if k > 1 else {}),
            }
            for s in est.sources
            for (t, n), (i, k) in zip(s.links, s.parts or [(0, 1)] * len(s.links), strict=True)
        ],
        "sources": [
            {
                "rank": s.rank,
                "pp_stage": s.pp_stage,
                "targets": [f"e{t.engine}r{t.rank}" for t, _ in s.links],
                "parts": [f"{i + 1}/{k}" for i, k in s.parts] if any(k > 1 for _, k in s.parts) else None,
                "wire_bytes": s.wire_bytes,
                "convert_bytes": s.convert_bytes,
                "wire_s": s.wire_s,
                "convert_s": s.convert_s,
                "predicted_s": s.predicted_s,
            }
            for s in est.sources
        ],
        "total_bytes": est.total_bytes,
        "senders": len(est.senders),
        "slowest_source": est.slowest.rank,
        "send_floor_s": est.send_floor_s,
        "receive_floor_s": est.receive_floor_s,
        "wire_floor_s": est.wire_floor_s,
        "bound": est.bound,
        "predicted_s": est.predicted_s,
    }


def without_split_json(est: SyncEstimate) -> dict:
    """The same layouts with one source per target and stage (idle ranks), beside the split's figures."""
    return {
        "senders_without_split": len(est.senders),
        "wire_floor_without_split_s": est.wire_floor_s,
        "predicted_without_split_s": est.predicted_s,
    }


def print_estimate(
    est: SyncEstimate, trainer: Parallelism, rollout: Parallelism, unsplit: SyncEstimate | None = None
) -> None:
    print(
        f"trainer {trainer.describe()}: {trainer.trainer_ranks} ranks (dp={trainer.trainer_dp}), "
        f"{trainer.trainer_ranks // trainer.pp} sources per stage"
    )
    print(f"rollout {rollout.describe()}: {rollout.engines * rollout.tp} target ranks")
    sizes = sorted(set(est.target_bytes.values()))
    print(f"bytes per target rank (from the write plans): {', '.join(gb_text(n) for n in sizes)}")
    print(HEADER)
    for line in source_lines(est.sources, gb_text):
        print(line)
    slow = est.slowest
    print(
        f"slowest source {slow.rank} (stage {slow.pp_stage}): {gb_text(slow.wire_bytes)} -> send floor "
        f"{est.send_floor_s:.3f} s at {est.nic_gbits:g} Gb/s; largest target {gb_text(max(sizes))} -> receive floor "
        f"{est.receive_floor_s:.3f} s at {est.receive_gbits:g} Gb/s; predicted sync "
        f"{est.predicted_s:.3f} s ({est.bound}-bound)"
    )
    if unsplit is not None:
        print(
            f"{len(est.senders)} of {len(est.sources)} sources send; without the split (one source per target and "
            f"stage) {len(unsplit.senders)} would: predicted {unsplit.predicted_s:.3f} s"
        )


def assumptions_text(
    nic_gbits: float,
    convert_gbps: float,
    convert_given: bool,
    slot_bytes: int,
    fp8: bool,
    rollout_nic: float,
    fsdp: bool = False,
) -> dict:
    measured = DEFAULT_FP8_CONVERT_SOURCE if fp8 else DEFAULT_CONVERT_SOURCE
    source = "given with --convert-gbps" if convert_given else measured
    export = "every FSDP rank's full-tensor gathers" if fsdp else "Megatron all-gathers"
    return {
        "nic": f"one {nic_gbits:g} Gb/s NIC per trainer GPU ({nic_gbits / 8:g} GB/s)",
        "rollout_nic": f"one {rollout_nic:g} Gb/s NIC per rollout GPU ({rollout_nic / 8:g} GB/s): a target rank's "
        "bytes arrive through it however many sources split them",
        "convert": f"{convert_gbps:g} GB/s of rollout bytes produced per source ({source})",
        "pipeline": f"two transfer slots of {slot_bytes >> 20} MB: predicted = max(max(convert, wire) + one "
        "slot, the largest target's receive time)",
        "not_counted": f"by the layout estimate: the trainer's HF export ({export}) and the rollout's pause/resume "
        "calls (the whole-sync line adds them, from measured rates)",
    }


def published_line(p: PublishedSync) -> str:
    return f"{p.system}: {p.figure()} ({p.setting})"

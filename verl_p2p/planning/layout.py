"""A rollout rank's parallel layout, derived from its SGLang server args (no upstream endpoint publishes it).

Pure: no I/O. docs/protocol.md section 6 gives the arithmetic; a published layout (some SGLang forks serve one)
is preferred and must agree with the derived one.

The server args arrive as a JSON answer (`/server_info`): `check_server_info` refuses one whose layout fields
have the wrong type or impossible values (MalformedAnswerError) before any arithmetic runs on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl_p2p.errors import MalformedAnswerError, UnsupportedLayoutError
from verl_p2p.planning.weight_caches import server_arg_cache_problems

# Layout fields of /server_info: (least value, default). An engine spanning more ranks than MAX_RANKS is not a
# real answer (and would make the trainer plan that many targets).
MAX_RANKS = 4096
_SIZE_FIELDS = {
    "tp_size": 1,
    "ep_size": 1,
    "dp_size": 1,
    "attn_dp_size": 1,
    "pp_size": 1,
    "moe_dp_size": 1,
    "attn_cp_size": 1,
    "context_parallel_size": 1,
}
_COUNT_FIELDS = ("ep_num_redundant_experts",)
_FLAG_FIELDS = ("enable_dp_attention", "enable_dp_lm_head", "enable_eplb")
DP_FIX = (
    "set actor_rollout_ref.rollout.engine_kwargs.sglang.enable_dp_attention=true (attention data parallelism "
    "inside one model copy), or run more rollout replicas with actor_rollout_ref.rollout.data_parallel_size=1"
)


@dataclass(frozen=True)
class RankLayout:
    """Which shard of every parameter family rollout rank `tp_rank` holds."""

    tp_size: int
    tp_rank: int
    attn_tp_size: int
    attn_tp_rank: int
    attn_dp_size: int
    attn_dp_rank: int
    ep_size: int
    moe_ep_rank: int
    moe_tp_size: int
    moe_tp_rank: int
    enable_dp_lm_head: bool = False

    @property
    def key(self) -> tuple:
        """Hashable identity: two ranks with equal keys (and equal server args) hold equal bytes."""
        return (
            self.tp_size,
            self.tp_rank,
            self.attn_tp_size,
            self.attn_dp_size,
            self.ep_size,
            self.moe_tp_size,
            self.enable_dp_lm_head,
        )


_PUBLISHED_FIELDS = (
    "tp_size",
    "tp_rank",
    "attn_tp_size",
    "attn_tp_rank",
    "attn_dp_rank",
    "moe_ep_rank",
    "moe_tp_size",
    "moe_tp_rank",
)


def _int(server_args: Mapping[str, Any], name: str, default: int) -> int:
    value = server_args.get(name)
    return default if value is None else int(value)


def check_server_info(server_info: Any, where: str = "rollout server") -> None:
    """Refuse a `/server_info` answer whose layout fields are not what SGLang reports (MalformedAnswerError)
    or whose sizes cannot belong to one engine (UnsupportedLayoutError): every field named, nothing derived."""
    if not isinstance(server_info, Mapping):
        raise MalformedAnswerError(f"{where}: server info is a {type(server_info).__name__}, not a JSON object")
    problems = []
    for name in (*_SIZE_FIELDS, *_COUNT_FIELDS):
        value = server_info.get(name)
        if value is None:
            continue
        least = 0 if name in _COUNT_FIELDS else 1
        if not isinstance(value, int) or isinstance(value, bool):
            problems.append(f"{name}={value!r} is not an integer")
        elif not least <= value <= MAX_RANKS:
            problems.append(f"{name}={value} is outside {least}..{MAX_RANKS}")
    for name in _FLAG_FIELDS:
        value = server_info.get(name)
        if value is not None and not isinstance(value, bool):
            problems.append(f"{name}={value!r} is not true/false")
    version = server_info.get("version")
    if version is not None and not isinstance(version, str):
        problems.append(f"version={version!r} is not a release string")
    if problems:
        raise MalformedAnswerError(f"{where}: malformed server info: " + "; ".join(problems))
    tp = _int(server_info, "tp_size", 1)
    for name in ("ep_size", "attn_dp_size"):
        value = _int(server_info, name, 1)
        if tp % value:
            problems.append(f"tp_size={tp} is not divisible by {name}={value}")
    if server_info.get("enable_dp_attention") and tp % _int(server_info, "dp_size", 1):
        problems.append(f"tp_size={tp} is not divisible by dp_size={_int(server_info, 'dp_size', 1)} (DP attention)")
    if problems:
        raise UnsupportedLayoutError(f"{where}: inconsistent parallel sizes: " + "; ".join(problems))


def model_copies(dp_size: int, enable_dp_attention: bool, attn_dp_size: int | None = None) -> int:
    """How many copies of the model one engine runs side by side. SGLang's `dp_size` is attention data
    parallelism inside one copy when DP attention is on (releases before 0.5.22 report it so), else a count of
    copies; releases that report `attn_dp_size` > 1 count copies in `dp_size` alone."""
    if enable_dp_attention and not (attn_dp_size and attn_dp_size > 1):
        return 1
    return max(1, dp_size)


def dp_problem(dp_size: int, enable_dp_attention: bool, attn_dp_size: int | None = None) -> str | None:
    """Why this DP setting cannot be synced, or None: every copy's ranks register with the engine's bootstrap
    server by tp_rank, so the copies overwrite each other's rank info and p2p would reach only one of them."""
    copies = model_copies(dp_size, enable_dp_attention, attn_dp_size)
    if copies <= 1:
        return None
    how = f"on top of attention DP (attn_dp_size={attn_dp_size})" if enable_dp_attention else "without DP attention"
    return (
        f"dp_size={dp_size} {how} runs {copies} copies of the model in one engine, whose ranks register their "
        "weight memory with the bootstrap server under the same tp_rank and overwrite each other (p2p would "
        f"update one copy and leave the others stale). Fix: {DP_FIX}"
    )


SPECULATIVE = "speculative_algorithm"
# Speculative algorithms that draft without a model of their own: no second model runner publishes a table.
DRAFTLESS_SPECULATION = ("NGRAM",)
SGLANG_SPECULATIVE_FIX = "https://github.com/sgl-project/sglang/pull/35312"


def speculative_problem(server_args: Mapping[str, Any]) -> str | None:
    """Why a rollout running speculative decoding with a draft model (EAGLE, EAGLE3, NEXTN/MTP, STANDALONE)
    cannot be synced, or None. Every model runner, the draft's too, publishes its transfer-engine table to the
    bootstrap server under the bare tp_rank, last writer wins; the draft is built after the target, so the rank
    info describes the DRAFT (and, for MTP, embed/head memory the draft frees after load): p2p would write the
    target's weights into the draft or into freed memory and report success."""
    algorithm = server_args.get(SPECULATIVE)
    if algorithm in (None, "", "NONE") or str(algorithm).upper() in DRAFTLESS_SPECULATION:
        return None
    return (
        f"{SPECULATIVE}={algorithm!r}: with speculative decoding every model runner, the draft's too, publishes "
        "its weight memory to the engine's bootstrap server under the bare tp_rank and the draft (built last) "
        "overwrites the target's entry, so p2p would write the target's weights into the draft model (or into "
        "memory the draft freed) and report success. The refusal lifts once the rollout's SGLang keys that table "
        f"by (worker, tp_rank) (SGLang PR #35312, {SGLANG_SPECULATIVE_FIX}, open and not in 0.5.23). Fix: launch "
        f"the rollout without {SPECULATIVE} (NGRAM, which has no draft model, is accepted)"
    )


def check_reproducible(server_args: Mapping[str, Any]) -> None:
    """Reject rollout settings whose bytes the replica cannot reproduce, or whose served weights p2p's writes would
    not reach (SGLang's derived-weight caches, `planning.weight_caches`), naming the setting and the fix."""
    check_server_info(server_args)
    problems = []
    dp = dp_problem(
        _int(server_args, "dp_size", 1), bool(server_args.get("enable_dp_attention")), server_args.get("attn_dp_size")
    )
    if dp is not None:
        problems.append(dp)
    speculative = speculative_problem(server_args)
    if speculative is not None:
        problems.append(speculative)
    problems += server_arg_cache_problems(server_args)
    if _int(server_args, "pp_size", 1) != 1:
        problems.append("pp_size > 1 (rollout pipeline parallelism): use tp/ep instead")
    if _int(server_args, "ep_num_redundant_experts", 0) != 0:
        problems.append("ep_num_redundant_experts > 0: the expert-location map is not published; set it to 0")
    if server_args.get("enable_eplb"):
        problems.append("enable_eplb: expert placement changes at run time; turn EPLB off")
    if server_args.get("init_expert_location") not in (None, "trivial"):
        problems.append("init_expert_location is not 'trivial': use the trivial expert placement")
    if _int(server_args, "moe_dp_size", 1) != 1:
        problems.append("moe_dp_size > 1: not supported; set moe_dp_size=1")
    for cp in ("attn_cp_size", "context_parallel_size"):
        if _int(server_args, cp, 1) != 1:
            problems.append(f"{cp} > 1: attention context parallelism is not supported")
    if problems:
        raise UnsupportedLayoutError("p2p cannot reproduce this rollout layout: " + "; ".join(problems))


def layout_from_server_args(
    server_args: Mapping[str, Any], rank: int, published: Mapping[str, Any] | None = None
) -> RankLayout:
    """Layout of rollout rank `rank` from `/server_info`; cross-checked against `published` when given."""
    check_reproducible(server_args)
    tp = _int(server_args, "tp_size", 1)
    ep = _int(server_args, "ep_size", 1)
    dp = _int(server_args, "dp_size", 1)
    # SGLang >= 0.5.22 reports attention DP as `attn_dp_size` (dp_size then counts replicas).
    attn_dp = _int(server_args, "attn_dp_size", 1)
    if attn_dp == 1 and server_args.get("enable_dp_attention"):
        attn_dp = dp
    if not 0 <= rank < tp:
        raise UnsupportedLayoutError(f"rank {rank} is outside tp_size={tp}")
    if tp % attn_dp or tp % ep:
        raise UnsupportedLayoutError(f"tp_size={tp} is not divisible by attention dp={attn_dp} / ep_size={ep}")
    attn_tp = tp // attn_dp
    moe_tp = tp // ep
    layout = RankLayout(
        tp_size=tp,
        tp_rank=rank,
        attn_tp_size=attn_tp,
        attn_tp_rank=rank % attn_tp,
        attn_dp_size=attn_dp,
        attn_dp_rank=rank // attn_tp,
        ep_size=ep,
        moe_ep_rank=rank // moe_tp,
        moe_tp_size=moe_tp,
        moe_tp_rank=rank % moe_tp,
        enable_dp_lm_head=bool(server_args.get("enable_dp_lm_head")) and attn_dp > 1,
    )
    if published:
        disagree = [
            f"{f}: published {published[f]} vs derived {getattr(layout, f)}"
            for f in _PUBLISHED_FIELDS
            if f in published and int(published[f]) != getattr(layout, f)
        ]
        if disagree:
            raise UnsupportedLayoutError(f"rank {rank}: published layout disagrees with server args: {disagree}")
    return layout

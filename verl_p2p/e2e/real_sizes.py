"""Real-width shapes for `verl-p2p e2e` (issue 35) and the arithmetic of what one GPU holds.

The widths come from the published configs in `planning/model_cards.py` (one copy of each shape); only the depth
is chosen here. `REAL_SIZES` has the form of `verl_p2p.e2e.run.SIZES` entries (overrides of the sandbox's tiny
config of an arch), so `--size real` runs the models p2p exists for at their real widths.

`one_gpu_budget` answers "does this run fit on one GPU" with the e2e's own residents (the trainer's model and the
initial copy it keeps to set weight sets, the rollout under test, the fresh reference server) and SGLang's KV rule
(the same in 0.5.12, 0.5.21 and 0.5.23, `sglang_kv_room`): a server's KV pool gets what `mem_fraction_static` of the
memory free when it starts leaves after its weights, capped by the e2e's `--max-total-tokens`. So a running server
holds its weights and that capped pool, not its whole fraction. A run is refused here, with the arithmetic, before
anything is written or launched; `verl_p2p/e2e/mem_fraction.py` asks it for the fraction of the GPU at hand.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from verl_p2p.e2e.rollouts import MAX_TOTAL_TOKENS
from verl_p2p.planning.hf_names import hf_tensor_specs
from verl_p2p.planning.model_cards import model_card

GIB = 1 << 30
H200_BYTES = 139 * GIB  # what one H200 reports usable (about 139 GiB of its 141 GB)
# nvidia-smi's memory.total less what the driver keeps: the H200's 143,771 MiB give H200_BYTES
DRIVER_RESERVE_BYTES = 143_771 * (1 << 20) - H200_BYTES
QWEN3_30B_A3B_LAYERS = 48  # the published depth
DEEPSEEK_V3_REAL_LAYERS = 2  # the first (dense) layer and one MoE layer
# issue 35's floor for one sync: >= 9,000 tensors and >= 28 GB (docs/measurements/real_sizes.md)
QWEN3_FLOOR_LAYERS = 24


def qwen3_30b_a3b(num_hidden_layers: int = QWEN3_30B_A3B_LAYERS) -> dict[str, Any]:
    """Qwen3-30B-A3B's published config.json at `num_hidden_layers` (every layer MoE, as published)."""
    if not 1 <= num_hidden_layers <= QWEN3_30B_A3B_LAYERS:
        raise ValueError(f"num_hidden_layers={num_hidden_layers}: Qwen3-30B-A3B has 1..{QWEN3_30B_A3B_LAYERS} layers")
    return model_card("qwen3-30b-a3b", num_hidden_layers)


def deepseek_v3(num_hidden_layers: int = DEEPSEEK_V3_REAL_LAYERS, fp8: bool = False) -> dict[str, Any]:
    """DeepSeek-V3's published widths with its first layer dense (first_k_dense_replace=1) and the rest MoE, so two
    layers hold one dense and one MoE layer; `fp8` adds the block-FP8 `quantization_config` DeepSeek-V3 ships
    (128x128 e4m3, dynamic activations), which is the one the trainer's quantizer writes."""
    if num_hidden_layers < 2:
        raise ValueError(
            f"num_hidden_layers={num_hidden_layers}: DeepSeek-V3 at real widths needs >= 2 layers (the first dense, "
            "then at least one MoE layer)"
        )
    cfg = dict(model_card("deepseek-v3", num_hidden_layers), first_k_dense_replace=1)
    if fp8:
        from verl_p2p.trainer.fp8_checkpoint import DEFAULT_QUANTIZATION_CONFIG

        cfg["quantization_config"] = dict(DEFAULT_QUANTIZATION_CONFIG)
    return cfg


def as_size_overrides(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A full config as `SIZES` overrides of the sandbox's tiny config: every field but the dtype (the e2e picks it)
    and the quantization (`--fp8` has the trainer's quantizer write the block-FP8 copy and its config)."""
    return {k: v for k, v in cfg.items() if k not in ("torch_dtype", "quantization_config")}


# `--size real` for `verl_p2p.e2e.run.SIZES` (the lead wires it in): DeepSeek-V3's dense + MoE layer, and
# Qwen3-30B-A3B at the depth the H200 runs were planned at (one H200 holds more: see `largest_depth`).
REAL_SIZES: dict[str, dict[str, Any]] = {
    "deepseek_v3": as_size_overrides(deepseek_v3()),
    "qwen3_moe": as_size_overrides(qwen3_30b_a3b(15)),
}


@dataclass(frozen=True)
class SyncBytes:
    """What one sync of a model moves into a TP1 rollout: its tensors and bytes in bf16 and as block-FP8."""

    layers: int
    tensors: int
    bf16_bytes: int
    fp8_tensors: int  # weights plus one scale tensor per quantized weight
    fp8_bytes: int
    kv_token_bytes: int  # one token of a TP1 server's bf16 KV pool (`kv_token_bytes`)


def kv_token_bytes(cfg: Mapping[str, Any]) -> int:
    """SGLang's cell size for a TP1 server with a bf16 KV cache (`pool_configurator.py`): K and V of every layer's
    KV heads, or with MLA (`kv_lora_rank`) the compressed latent and the rope key. It counts every layer, so for a
    hybrid model it is an upper bound."""
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("kv_lora_rank"):
        return (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])) * layers * 2
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return int(kv_heads) * 2 * int(head_dim) * layers * 2


def sync_bytes(cfg: Mapping[str, Any]) -> SyncBytes:
    """Bytes of a whole-model sync, from the tensor list of the config (bf16) and of its block-FP8 checkpoint."""
    import torch

    from verl_p2p.trainer.fp8_checkpoint import fp8_checkpoint_model

    bf16 = {k: v for k, v in cfg.items() if k != "quantization_config"}
    bf16["torch_dtype"] = "bfloat16"
    specs = {n: (s, getattr(torch, d)) for n, s, d in hf_tensor_specs(bf16)}
    _, fp8_specs = fp8_checkpoint_model(bf16, specs)
    return SyncBytes(
        layers=int(cfg["num_hidden_layers"]),
        tensors=len(specs),
        bf16_bytes=sum(_numel(s) * d.itemsize for s, d in specs.values()),
        fp8_tensors=len(fp8_specs),
        fp8_bytes=sum(_numel(s) * d.itemsize for s, d in fp8_specs.values()),
        kv_token_bytes=kv_token_bytes(cfg),
    )


def sglang_kv_room(free_before_load: float, free_after_load: float, mem_fraction: float) -> float:
    """SGLang's room for a server's KV pool (0.5.12 `model_runner_kv_cache_mixin._profile_available_bytes`, 0.5.21
    and 0.5.23 `kv_cache_configurator.py`): what is free after its weights loaded less the part of what was free
    before that `mem_fraction_static` leaves to others. At or below zero the server refuses to start ("Not enough
    memory"); above it the pool is this room or the `--max-total-tokens` cap, whichever is smaller."""
    return free_after_load - free_before_load * (1 - mem_fraction)


@dataclass(frozen=True)
class GpuBudget:
    """One e2e run on one GPU: who holds what, and whether SGLang's KV rule admits every server.

    The trainer holds its bf16 model twice (the parameters and the initial copy `e2e/trainer.py` scales into
    weight sets) plus two transfer slots; it loads before the servers measure free memory (worst case of the
    e2e's concurrent start). A server needs `sglang_kv_room` >= its KV pool (the e2e's token cap), and once up it
    holds its weights, that pool and a process context: the last server to start (the fresh one, beside the one
    under test and every other model's) sees the least free memory, so it sets the fraction."""

    gpu_bytes: int
    trainer_bytes: int
    server_weight_bytes: int  # the largest server's
    kv_min_bytes: int  # its KV pool
    context_bytes: int  # CUDA context, NCCL, cuBLAS workspaces, CUDA graphs, activations of one process
    fresh_server: bool
    servers: int  # SGLang servers up at once
    free_last_bytes: int  # what the last server to start finds free
    mem_fraction: float | None  # the smallest that admits every server, None when none does
    fits: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v / GIB, 2) if k.endswith("_bytes") else v) for k, v in asdict(self).items()}


def one_gpu_budget(
    trainer_model_bytes: int | Sequence[int],
    server_weight_bytes: int | Sequence[int],
    *,
    fresh_server: bool = True,
    gpu_bytes: int = H200_BYTES,
    slot_bytes: int = 2 * 512 * (1 << 20),
    kv_min_bytes: int | Sequence[int] = 2 * GIB,
    context_bytes: int = 3 * GIB,
    trainer_copies: int = 2,
) -> GpuBudget:
    """Whether the trainer, the rollout under test and (`fresh_server`) a fresh server fit, under SGLang's rule
    (`sglang_kv_room`). A sequence in the first two (and `kv_min_bytes`) is one entry per model, for models whose
    harnesses share the GPU (the e2e starts them all at once). `kv_min_bytes`: each server's KV pool (the e2e caps
    it; `budget_of` computes it). `trainer_copies`: 2 for the e2e's trainer (parameters + the initial copy), 1 for
    one holding its model once."""
    models = _per_model(trainer_model_bytes)
    weights = _per_model(server_weight_bytes, len(models))
    kvs = _per_model(kv_min_bytes, len(models))
    if not len(models) == len(weights) == len(kvs):
        raise ValueError("one_gpu_budget: give one trainer, server and KV figure per model")
    trainer = sum(trainer_copies * m + slot_bytes + context_bytes for m in models)
    servers = [(w, kv) for w, kv in zip(weights, kvs, strict=True) for _ in range(2 if fresh_server else 1)]
    last_w, last_kv = max(servers, key=sum)  # the largest starts last: it sees every other server up
    beside = sum(w + kv + context_bytes for w, kv in servers) - (last_w + last_kv + context_bytes)
    free_last = gpu_bytes - trainer - beside - context_bytes
    chosen = None
    for step in range(5, 96):  # one mem_fraction for every server (the e2e passes one), up to SGLang's sane range
        if sglang_kv_room(free_last, free_last - last_w, step / 100) >= last_kv:
            chosen = step / 100
            break
    need = last_w + last_kv
    if chosen is not None:
        why = f"mem_fraction {chosen:.2f} admits {'every server' if len(servers) > 1 else 'the server'}"
    elif free_last < need:
        why = (
            f"after the trainer ({trainer / GIB:.1f} GiB) and {len(servers) - 1} other server(s) "
            f"({beside / GIB:.1f} GiB) only {free_last / GIB:.1f} GiB are free, less than one server's weights + KV "
            f"pool ({need / GIB:.1f} GiB)"
        )
    else:
        why = (
            f"the last server to start finds {free_last / GIB:.1f} GiB free beside the trainer ({trainer / GIB:.1f} "
            f"GiB) and {len(servers) - 1} other server(s) ({beside / GIB:.1f} GiB): its weights ({last_w / GIB:.1f} "
            f"GiB) + KV pool ({last_kv / GIB:.1f} GiB) need a mem_fraction of {need / free_last:.2f}, above 0.95"
        )
    return GpuBudget(
        gpu_bytes,
        trainer,
        last_w,
        last_kv,
        context_bytes,
        fresh_server,
        len(servers),
        free_last,
        chosen,
        chosen is not None,
        why,
    )


def _per_model(value: int | Sequence[int], n: int = 1) -> list[int]:
    return [int(value)] * n if isinstance(value, int | float) else [int(v) for v in value]


def budget_of(
    cfg: Mapping[str, Any] | SyncBytes | Sequence[Mapping[str, Any] | SyncBytes],
    rollout_quant: str,
    fresh_server: bool = True,
    **kwargs: Any,
) -> GpuBudget:
    """`one_gpu_budget` of a config (or its `sync_bytes`, or a list of them: models sharing the GPU): a bf16 trainer
    and a `rollout_quant` ("bf16" or "fp8") rollout whose KV pool is the e2e's `MAX_TOTAL_TOKENS` cap."""
    if rollout_quant not in ("bf16", "fp8"):
        raise ValueError(f"rollout_quant={rollout_quant!r}: choose 'bf16' or 'fp8'")
    many = cfg if isinstance(cfg, list | tuple) else [cfg]
    sbs = [c if isinstance(c, SyncBytes) else sync_bytes(c) for c in many]
    served = [sb.bf16_bytes if rollout_quant == "bf16" else sb.fp8_bytes for sb in sbs]
    kwargs.setdefault("kv_min_bytes", [MAX_TOTAL_TOKENS * sb.kv_token_bytes for sb in sbs])
    return one_gpu_budget([sb.bf16_bytes for sb in sbs], served, fresh_server=fresh_server, **kwargs)


DISK_BYTES = 64 * GIB  # the H200 machine's disk
DISK_RESERVE_BYTES = 10 * GIB  # the unpacked SGLang 0.5.21 stack, its wheels, logs


@dataclass(frozen=True)
class DiskBudget:
    """The checkpoints one e2e writes: weight set 0 (the trainer and the rollout under test load it) and weight set
    1 (the fresh server's), each bf16, and with an FP8 rollout the block-FP8 copy of each beside it."""

    checkpoint_bytes: int
    free_bytes: int
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v / GIB, 2) if k.endswith("_bytes") else v) for k, v in asdict(self).items()}


def disk_budget(
    cfg: Mapping[str, Any] | SyncBytes,
    rollout_quant: str,
    disk_bytes: int = DISK_BYTES,
    reserve_bytes: int = DISK_RESERVE_BYTES,
) -> DiskBudget:
    sb = cfg if isinstance(cfg, SyncBytes) else sync_bytes(cfg)
    written = 2 * sb.bf16_bytes + (2 * sb.fp8_bytes if rollout_quant == "fp8" else 0)
    free = disk_bytes - reserve_bytes
    return DiskBudget(written, free, written <= free)


def largest_depth(rollout_quant: str, fresh_server: bool = True, disk: bool = False, **kwargs: Any) -> int | None:
    """The deepest Qwen3-30B-A3B (1..48 layers) whose e2e fits on one GPU (and, with `disk`, whose checkpoints fit
    on the machine's disk), None when not even one layer does."""
    best = None
    for layers in range(1, QWEN3_30B_A3B_LAYERS + 1):
        sb = qwen3_sync_bytes(layers)
        if budget_of(sb, rollout_quant, fresh_server, **kwargs).fits and (
            not disk or disk_budget(sb, rollout_quant).fits
        ):
            best = layers
    return best


@functools.cache
def qwen3_sync_bytes(layers: int) -> SyncBytes:
    """`sync_bytes` of Qwen3-30B-A3B at a depth, kept: a pure function of the depth that `largest_depth` asks for
    every depth of every budget. Every layer of the model holds the same tensors (all MoE), so past two layers it
    is the one-layer count plus one layer's increment per layer (tests/test_real_sizes.py holds it equal to a
    count of every tensor); listing every tensor of every depth made the dry step's arithmetic seconds long."""
    if layers <= 2:
        return sync_bytes(qwen3_30b_a3b(layers))
    one, two = qwen3_sync_bytes(1), qwen3_sync_bytes(2)
    fields = ("tensors", "bf16_bytes", "fp8_tensors", "fp8_bytes", "kv_token_bytes")
    grown = {f: getattr(one, f) + (layers - 1) * (getattr(two, f) - getattr(one, f)) for f in fields}
    return SyncBytes(layers=layers, **grown)


def usable_gpu_bytes(total_mib: int) -> int:
    """The bytes `one_gpu_budget` may plan with on a GPU whose nvidia-smi memory.total is `total_mib`."""
    return total_mib * (1 << 20) - DRIVER_RESERVE_BYTES


@dataclass(frozen=True)
class GpuStep:
    """One real-size e2e on the GPU at hand: its depth, the mem fraction the arithmetic admits and the bytes of weight
    set 1 (and its FP8 copy) that go to host memory; `refusal` says why it cannot run there instead."""

    layers: int
    mem_fraction: float | None
    weights1_bytes: int
    refusal: str


def gpu_step(model: str, rollout_quant: str, gpu_bytes: int = H200_BYTES, one_server: bool = False) -> GpuStep:
    """The e2e of `model` ("deepseek_v3" or "qwen3_moe") on one GPU of `gpu_bytes`: DeepSeek-V3 at its two real
    layers; Qwen3-30B-A3B at REAL_SIZES' depth, or with `one_server` (the e2e's --one-server-at-a-time: the fresh
    server never beside the one under test) at issue 35's floor; the deepest that GPU holds where that is less."""
    fresh = not one_server
    if model == "deepseek_v3":
        layers = DEEPSEEK_V3_REAL_LAYERS
    elif model == "qwen3_moe":
        wanted = QWEN3_FLOOR_LAYERS if one_server else REAL_SIZES["qwen3_moe"]["num_hidden_layers"]
        layers = min(wanted, largest_depth(rollout_quant, fresh, gpu_bytes=gpu_bytes) or 0)
    else:
        raise ValueError(f"model {model!r}: the real-size steps run deepseek_v3 or qwen3_moe")
    sb = sync_bytes(deepseek_v3(layers)) if model == "deepseek_v3" else qwen3_sync_bytes(max(layers, 1))
    budget = budget_of(sb, rollout_quant, fresh, gpu_bytes=gpu_bytes)
    weights1 = sb.bf16_bytes + (sb.fp8_bytes if rollout_quant == "fp8" else 0)
    refusal = (
        "" if budget.fits and layers >= 1 else f"{model} {rollout_quant} on {gpu_bytes / GIB:.0f} GiB: {budget.why}"
    )
    return GpuStep(layers, budget.mem_fraction, weights1, refusal)


def summary() -> dict[str, Any]:
    """The table docs/measurements/real_sizes.md quotes: bytes per depth and what one H200 holds."""
    rows = []
    for layers in (1, 2, 6, 12, 15, 23, 24, 35, 43, 48):
        cfg = qwen3_30b_a3b(layers)
        rows.append(
            {
                "model": "qwen3-30b-a3b",
                **asdict(sync_bytes(cfg)),
                **{
                    f"{q}_{'fresh' if f else 'alone'}": budget_of(cfg, q, f).to_dict()
                    for q in ("bf16", "fp8")
                    for f in (True, False)
                },
                "disk": {q: disk_budget(cfg, q).to_dict() for q in ("bf16", "fp8")},
            }
        )
    for layers in (2, 3):
        cfg = deepseek_v3(layers)
        rows.append(
            {
                "model": "deepseek-v3",
                **asdict(sync_bytes(cfg)),
                **{f"{q}_fresh": budget_of(cfg, q).to_dict() for q in ("bf16", "fp8")},
                **{f"{q}_alone": budget_of(cfg, q, False).to_dict() for q in ("bf16", "fp8")},
                "disk": {q: disk_budget(cfg, q).to_dict() for q in ("bf16", "fp8")},
            }
        )
    largest = {
        f"{q}_{'fresh' if f else 'alone'}{'_disk' if d else ''}": largest_depth(q, f, d)
        for q in ("bf16", "fp8")
        for f in (True, False)
        for d in (False, True)
    }
    return {"rows": rows, "largest_qwen3_30b_a3b_depth": largest}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    import json

    print(json.dumps(summary(), indent=1))

"""`verl-p2p bench --device cpu|cuda`: how fast one trainer source turns HF tensors into rollout-rank bytes.

The HF tensors are already on the device (as the trainer's export yields them). For each executor
(`compiled`: copy programs; `sglang`: SGLang's `load_weights` per parameter, the reference) and each kind
of transfer slot (GPU memory, pinned host memory; plain host memory on a CPU host) it measures:

- `convert_gbps`: target bytes produced per second by the executor alone: every parameter of every rank
  of one engine (one source's work when it writes the whole engine), loaded into the two slots in turn,
  chunked where larger than a slot, the device synchronized at the end;
- `stage_gbps`: the source's whole data plane without the wire: `push()` over the HF stream (stager,
  executor, slots, flushes, CUDA fences, write submission) into a transport that discards the writes.

Both are per source, for target bytes (what lands on the rollout ranks). The compiled/reference ratio
is given per slot kind. Every compiled byte is checked against the reference executor first. `--fp8` adds the
same runs for a rollout serving the model's 128x128 block-FP8 checkpoint (`runs` rows with weights "fp8"):
there the HF tensors are still bf16 and each conversion includes the quantize step (`trainer/fp8_stream.py`),
timed, before the executor.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch


# Qwen3-30B-A3B's published shape (config.json of the model card); the layer count is the bench's choice.
class DiscardTransport:
    """A transport whose writes go nowhere: the wire left out, so `push()` measures the trainer side alone.
    Registration accepts any memory (host or GPU). Not a rollout and not a stand-in for one."""

    session_id = "discard"

    def register(self, addr: int, nbytes: int) -> None:
        pass

    def unregister(self, addr: int) -> None:
        pass

    def write(self, session_id, local_addrs, remote_addrs, lengths) -> None:
        pass


@dataclass(frozen=True)
class ConvertResult:
    executor: str
    slots: str
    target_bytes: int
    convert_seconds: list[float]
    stage_seconds: list[float]
    weights: str = "bf16"  # "fp8": 128x128 block-FP8 targets, the quantize step of the bf16 HF tensors included

    @property
    def convert_gbps(self) -> float:
        return self.target_bytes / statistics.median(self.convert_seconds) / 1e9

    @property
    def convert_gbps_best(self) -> float:
        return self.target_bytes / min(self.convert_seconds) / 1e9

    @property
    def stage_gbps(self) -> float:
        return self.target_bytes / statistics.median(self.stage_seconds) / 1e9 if self.stage_seconds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(convert_gbps=self.convert_gbps, convert_gbps_best=self.convert_gbps_best, stage_gbps=self.stage_gbps)
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_tensors(specs: dict, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF tensors on `device`: distinct tensors on a GPU (as an export yields them); on a CPU host
    views of one random pool (filling gigabytes on a shared 2-core host would dominate the run)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if device.type == "cuda":
        out = {}
        for name, (shape, dtype) in specs.items():
            t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0, 0.02, generator=gen)
            out[name] = t.to(dtype)
        return out
    from verl_p2p.cli.bench_model import SyntheticStream

    stream = SyntheticStream(specs, seed)
    return {name: stream.tensor(name) for name in specs}


def _slots(kind: str, slot_bytes: int, device: torch.device) -> list[torch.Tensor]:
    if kind == "gpu":
        return [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    return [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=kind == "pinned") for _ in range(2)]


def convert_once(executors: Sequence, hf: dict, slots: list[torch.Tensor], device: torch.device, prepare=None) -> float:
    """Every parameter of every executor's rank into the two slots in turn; seconds until the device is done.
    `prepare` (FP8 targets: the quantize step) turns the HF tensors into the executors' feeds, timed too."""
    from verl_p2p.transfer.buffers import ALIGN

    slot_bytes = slots[0].numel()
    which, fill = 0, 0
    _sync(device)
    t0 = time.perf_counter()
    if prepare is not None:
        hf = prepare(hf)
    for ex in executors:
        for name, p in ex.plan.params.items():
            feeds = {n: hf[n] for n in p.feeds}
            pieces = ex.chunks(name, slot_bytes) if p.nbytes > slot_bytes or not p.feeds else [(0, p.nbytes)]
            for offset, length in pieces:
                start = -(-fill // ALIGN) * ALIGN
                if start + length > slot_bytes:
                    which, start = 1 - which, 0
                fill = start + length
                dst = slots[which][start : start + length]
                if length == p.nbytes and offset == 0 and p.feeds:
                    ex.load(name, feeds, dst)
                else:
                    ex.load_chunk(name, feeds, offset, dst)
    _sync(device)
    return time.perf_counter() - t0


def stage_once(executors: Sequence, hf: dict, buffers, device: torch.device) -> float:
    """`push()` of the HF stream to one target per rank, into a transport that discards the writes."""
    from verl_p2p.planning.targets import RemoteParam, RemoteRankInfo, TargetRank
    from verl_p2p.trainer.push import PushTarget, push
    from verl_p2p.transfer.writer import Writer

    targets = []
    addr = 1 << 40  # one "discard" session for every rank: their (fake) ranges must not overlap
    for r, ex in enumerate(executors):
        params = {}
        for name, p in ex.plan.params.items():
            params[name] = RemoteParam(addr, p.nbytes // p.dtype.itemsize, p.dtype.itemsize)
            addr += p.nbytes
        targets.append(PushTarget(TargetRank(0, r), ex, RemoteRankInfo("discard", params)))
    writer = Writer(buffers.transport, {t.target: t.remote for t in targets}, timeout_s=600.0)
    try:
        _sync(device)
        metrics = push(iter(list(hf.items())), targets, buffers, writer)
    finally:
        writer.close()
    return metrics.seconds_total


def check_exact(compiled: Sequence, reference: Sequence, hf: dict, device: torch.device) -> int:
    """Every parameter of every rank: compiled bytes == reference bytes (on `device`); the count checked."""
    checked = 0
    for ex, ref in zip(compiled, reference, strict=True):
        for name, p in ref.plan.params.items():
            feeds = {n: hf[n] for n in p.feeds}
            a = torch.empty(p.nbytes, dtype=torch.uint8, device=device)
            b = torch.empty(p.nbytes, dtype=torch.uint8, device=device)
            ex.load(name, feeds, a)
            ref.load(name, feeds, b)
            if not torch.equal(a, b):
                raise RuntimeError(f"rank {ref.layout.tp_rank} {name}: compiled bytes differ from SGLang's loader")
            checked += 1
    return checked


def run_convert_bench(
    device: str = "cpu",
    shape=None,
    tp_size: int = 2,
    ep_size: int = 2,
    slot_mb: int = 512,
    repeats: int = 3,
    executors: Sequence[str] = ("compiled", "sglang"),
    slot_kinds: Sequence[str] | None = None,
    stage: bool = True,
    verify: bool = True,
    out_path: str | None = None,
    argv: Sequence[str] | None = None,
    fp8: bool = False,
) -> dict:
    """Run the conversion bench and return (and write to `out_path`) its numbers."""
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()
    from verl_p2p.cli.bench_model import BenchShape, numel
    from verl_p2p.sandbox.tiny import hf_tensor_shapes

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    shape = shape or BenchShape()
    cfg = shape.config()
    specs = {n: (tuple(s), torch.bfloat16) for n, s in hf_tensor_shapes(cfg)}
    server_args = {"tp_size": tp_size, "ep_size": ep_size, "dtype": "bfloat16"}
    hf = hf_tensors(specs, dev)
    model_bytes = sum(numel(s) * 2 for s, _ in specs.values())
    if slot_kinds is None:
        slot_kinds = ("gpu", "pinned") if dev.type == "cuda" else ("host",)
    variants = [_variant_bf16(cfg, specs)] + ([_variant_fp8(cfg, specs)] if fp8 else [])
    result = {
        "command": " ".join(["verl-p2p", "bench", *(argv or [])]),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "sglang": _sglang_version(),
        "torch_threads": 1 if dev.type == "cpu" else torch.get_num_threads(),
        "shape": asdict(shape),
        "tp_size": tp_size,
        "ep_size": ep_size,
        "model_bytes": model_bytes,
        "slot_bytes": slot_mb << 20,
        "repeats": repeats,
        "runs": [],
        "goals": {"compiled_convert_gbps_gpu_slots": 200.0, "compiled_convert_gbps_pinned_slots": 40.0},
    }
    for weights, vcfg, vspecs, prepare in variants:
        part = _run_variant(
            weights,
            vcfg,
            vspecs,
            prepare,
            server_args,
            hf,
            dev,
            tp_size,
            slot_mb,
            repeats,
            executors,
            slot_kinds,
            stage,
            verify,
        )
        runs = part.pop("runs")
        result["runs"] += runs
        if weights == "bf16":
            result.update(part)
        else:
            result["fp8"] = part
    print(format_convert_table(result))
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _variant_bf16(cfg: dict, specs: dict) -> tuple:
    return "bf16", cfg, specs, None


def _variant_fp8(cfg: dict, specs: dict) -> tuple:
    """FP8 targets: the rollout serves the trainer's 128x128 block-FP8 checkpoint of the same model; its tensor
    list holds e4m3fn weights with fp32 block scales, and each conversion starts with the quantize step."""
    from verl_p2p.trainer.fp8_checkpoint import fp8_checkpoint_model
    from verl_p2p.trainer.fp8_stream import fp8_targets, quantized_stream

    fp8_cfg, fp8_specs = fp8_checkpoint_model(cfg, specs)
    targets = fp8_targets(fp8_specs)  # once per plan, as push keeps them (`fp8_stream.plan_fp8_targets`)

    def prepare(hf: dict) -> dict:
        return dict(quantized_stream(hf.items(), fp8_specs, targets=targets))

    return "fp8", fp8_cfg, fp8_specs, prepare


def _run_variant(
    weights, cfg, specs, prepare, server_args, hf, dev, tp_size, slot_mb, repeats, executors, slot_kinds, stage, verify
) -> dict:
    """One target kind (bf16 or FP8): build, compile, verify, then convert (and stage) per slot kind."""
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica.compiled import CompiledReplica
    from verl_p2p.replica.stream import RankReplica
    from verl_p2p.transfer.buffers import TransferBuffers

    t0 = time.perf_counter()
    references = [
        RankReplica.build(cfg, server_args, layout_from_server_args(server_args, r), specs) for r in range(tp_size)
    ]
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = [CompiledReplica(r) for r in references]
    for ex in compiled:  # compile every program push will run (full params and slot-sized chunks)
        for name, p in ex.plan.params.items():
            if name not in ex.fallbacks:
                for off, n in ex.chunks(name, slot_mb << 20) if p.nbytes > slot_mb << 20 else [(0, p.nbytes)]:
                    es = p.dtype.itemsize
                    ex.program(name, off // es, (off + n) // es)
    compile_s = time.perf_counter() - t0
    by_name = {"compiled": compiled, "sglang": references}
    target_bytes = sum(r.plan.nbytes for r in references)
    checked = check_exact(compiled, references, prepare(hf) if prepare else hf, dev) if verify else 0
    results = []
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # as push() runs its loads on a CPU host (load_threads=1)
    try:
        for kind in slot_kinds:
            conv: dict[str, list[float]] = {name: [] for name in executors}
            staged: dict[str, list[float]] = {name: [] for name in executors}
            slots = _slots(kind, slot_mb << 20, dev)
            for name in executors:  # warm-up: allocator, first-touch pages, lazy imports
                convert_once(by_name[name], hf, slots, dev, prepare)
            for _ in range(repeats):  # executors side by side, so a noisy host hits both alike
                for name in executors:
                    conv[name].append(convert_once(by_name[name], hf, slots, dev, prepare))
            del slots
            if stage:
                slot_device = dev if kind == "gpu" else torch.device("cpu")
                buffers = TransferBuffers(
                    slot_mb << 20, DiscardTransport(), device=slot_device, pin_memory=kind == "pinned"
                )
                try:
                    for name in executors:
                        stage_once(by_name[name], hf, buffers, dev)
                    for _ in range(repeats):
                        for name in executors:
                            staged[name].append(stage_once(by_name[name], hf, buffers, dev))
                finally:
                    buffers.release()
            results += [
                ConvertResult(name, kind, target_bytes, conv[name], staged[name], weights) for name in executors
            ]
    finally:
        torch.set_num_threads(threads)
    fallbacks = sorted({n for ex in compiled for n in ex.fallbacks})
    launches = sum(ex.program(n).launches for ex in compiled for n in ex.plan.params if n not in ex.fallbacks)
    copies = sum(ex.program(n).num_copies for ex in compiled for n in ex.plan.params if n not in ex.fallbacks)
    return {
        "weights": weights,
        "target_bytes_per_source": target_bytes,
        "replica_build_seconds": build_s,
        "compile_seconds": compile_s,
        "compiled_fallback_params": fallbacks,
        "compiled_copies": copies,
        "compiled_launches": launches,
        "params_per_source": sum(len(r.plan.params) for r in references),
        "verified_params": checked,
        "runs": [r.to_dict() for r in results],
        "ratios": _ratios(results),
    }


def _ratios(results: Sequence[ConvertResult]) -> dict:
    """compiled / reference, per slot kind, for convert and stage throughput."""
    out = {}
    by = {(r.executor, r.slots): r for r in results}
    for kind in dict.fromkeys(r.slots for r in results):
        c, s = by.get(("compiled", kind)), by.get(("sglang", kind))
        if c and s:
            out[kind] = {
                "convert": c.convert_gbps / s.convert_gbps,
                "stage": c.stage_gbps / s.stage_gbps if s.stage_gbps else None,
            }
    return out


def _sglang_version() -> str | None:
    try:
        import sglang

        return sglang.__version__
    except ImportError:  # pragma: no cover
        return None


def format_convert_table(r: dict) -> str:
    gb = 1e9
    head = [
        f"device {r['device']}  torch {r['torch']}  sglang {r['sglang']}  threads {r['torch_threads']}",
        f"rollout tp{r['tp_size']} ep{r['ep_size']}: {r['params_per_source']} params, "
        f"{r['target_bytes_per_source'] / gb:.2f} GB of target bytes per source (model {r['model_bytes'] / gb:.2f} GB)",
        f"compiled: {r['compiled_copies']} copies in {r['compiled_launches']} batched calls, "
        f"{len(r['compiled_fallback_params'])} params on SGLang's loader; compile {r['compile_seconds']:.2f} s; "
        f"verified {r['verified_params']} params byte for byte",
    ]
    if "fp8" in r:
        f = r["fp8"]
        head.append(
            f"fp8 targets (128x128 block e4m3fn + fp32 scales, quantize step included): {f['params_per_source']} "
            f"params, {f['target_bytes_per_source'] / gb:.2f} GB per source; verified {f['verified_params']} params"
        )
    head += ["", f"{'weights':<8} {'slots':<8} {'executor':<9} {'convert_gbps':>13} {'(best)':>8} {'stage_gbps':>11}"]
    rows = [
        f"{x['weights']:<8} {x['slots']:<8} {x['executor']:<9} {x['convert_gbps']:>13.2f} "
        f"{x['convert_gbps_best']:>8.2f} {x['stage_gbps']:>11.2f}"
        for x in r["runs"]
    ]
    ratios = [
        f"{w} compiled/reference on {k} slots: convert {v['convert']:.1f}x"
        + (f", stage {v['stage']:.1f}x" if v["stage"] else "")
        for w, part in [("bf16", r), *([("fp8", r["fp8"])] if "fp8" in r else [])]
        for k, v in part["ratios"].items()
    ]
    return "\n".join(head + rows + [""] + ratios)

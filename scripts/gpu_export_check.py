"""GPU check of the PP-local export: equality with Megatron-Bridge's full export (NCCL), and both export times.

    torchrun --nproc-per-node 2 scripts/gpu_export_check.py --tp 2          # TP=2
    torchrun --nproc-per-node 2 scripts/gpu_export_check.py --pp 2          # PP=2
    python scripts/gpu_export_check.py                                      # one GPU: TP=1 PP=1

Builds a small bf16 Qwen3 (default hidden 1024, 8 layers) through Megatron-Bridge on the GPUs, then on every
rank: (1) its stage's PP-local export, run under the cross-stage collective guard, must equal the full export
and the HF checkpoint bit for bit; (2) rank 0 checks that the stages partition the full export; (3) it times the
local export, the full export and the filtered fallback (`--repeat` runs each, median and min seconds).
Prints a table, writes JSON (`--json-out`), exits 1 on any mismatch.

Needs only torch, megatron-core, megatron-bridge, transformers, safetensors, einops (+ their import-time deps);
not verl: the repo's `verl_p2p` package is mapped without running its `__init__`. Without transformer_engine,
verl_p2p.sandbox.cpu_megatron installs its import stub and builds local (TE-free) layers. Import-time requirements
beyond torch and its own deps, found by blocking modules one at a time on the CPU host: megatron-core 0.19.2,
megatron-bridge 0.6.2 (install --no-deps), transformers 5.10.4, safetensors, einops, tokenizers, huggingface-hub,
regex, pyyaml, tqdm, httpx (+ httpcore, h11, idna, certifi, anyio), rich, omegaconf, antlr4-python3-runtime,
packaging, numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_paths() -> None:
    """verl_p2p's export modules without its package __init__ (which may import verl)."""
    if "verl_p2p" not in sys.modules:
        pkg = types.ModuleType("verl_p2p")
        pkg.__path__ = [str(ROOT / "verl_p2p")]
        sys.modules["verl_p2p"] = pkg


_import_paths()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from verl_p2p.sandbox.cpu_megatron import Parallel, build_tiny_megatron, install_te_stub  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (qwen3_moe only); ETP is then 1")
    p.add_argument("--arch", choices=["qwen3", "qwen3_moe"], default="qwen3")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo smoke test of this script")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--workdir", default=None, help="the checkpoint's folder, kept (default: a new temp dir)")
    p.add_argument("--json-out", default=None)
    return p.parse_args()


def _init(device: str) -> tuple[int, int]:
    if "RANK" not in os.environ:  # plain `python`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _model_config(args: argparse.Namespace) -> dict:
    heads = max(args.hidden // 64, 2)
    cfg = dict(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        head_dim=64,
        vocab_size=args.vocab,
    )
    if args.arch == "qwen3_moe":
        cfg.update(moe_intermediate_size=args.hidden // 4, num_experts=8, num_experts_per_tok=2)
    return cfg


def _write_checkpoint(args: argparse.Namespace, rank: int, dtype: torch.dtype) -> Path:
    from verl_p2p.sandbox.tiny import write_tiny_checkpoint

    cfg = _model_config(args)
    workdir = [args.workdir or (tempfile.mkdtemp(prefix="verl_p2p_gpu_export_check-") if rank == 0 else None)]
    dist.broadcast_object_list(workdir, src=0)  # never a fixed name in the shared /tmp: rank 0's new temp dir
    path = Path(workdir[0]) / f"{args.arch}_h{args.hidden}_l{args.layers}_v{args.vocab}_{str(dtype)[6:]}"
    if rank == 0 and not (path / "model.safetensors").exists():
        write_tiny_checkpoint(path, args.arch, id_encoded=False, dtype=dtype, **cfg)
    dist.barrier()
    return path


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(stream_factory, device: str, repeat: int) -> tuple[list[float], int, int]:
    """Seconds per full iteration of a fresh stream; tensors are only counted (no copies)."""
    seconds, count, nbytes = [], 0, 0
    for _ in range(repeat):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        count = nbytes = 0
        for _name, tensor in stream_factory():
            count += 1
            nbytes += tensor.numel() * tensor.element_size()
        _sync(device)
        seconds.append(time.perf_counter() - t0)
    return seconds, count, nbytes


def _mismatches(got: dict, want: dict, cast: bool = False) -> list[str]:
    """Names whose tensors differ: bit for bit, dtype included; with `cast`, compared in `want`'s dtype
    (the trainer may hold some parameters, e.g. TE-free norms, in fp32 while the checkpoint is bf16)."""
    bad = []
    for n, t in got.items():
        ref = want.get(n)
        if ref is not None and cast:
            t = t.to(ref.dtype)
        if ref is None or ref.dtype != t.dtype or ref.shape != t.shape or not torch.equal(ref, t):
            bad.append(n)
    return bad


def main() -> int:
    args = _args()
    rank, world = _init(args.device)
    tp, pp, ep = args.tp, args.pp, args.ep
    if world == 1 and (tp, pp, ep) != (1, 1, 1):
        print(f"one process: running TP=1 PP=1 EP=1 instead of TP={tp} PP={pp} EP={ep}", flush=True)
        tp = pp = ep = 1
    if world % (tp * pp):
        raise SystemExit(f"world size {world} is not a multiple of TP*PP={tp * pp}")
    dtype_name = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    install_te_stub()
    import logging
    import warnings

    logging.getLogger("megatron").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as mpu
    from safetensors import safe_open

    from verl_p2p.trainer.export import StageExporter
    from verl_p2p.trainer.stage_guard import stage_collective_guard

    hf_dir = _write_checkpoint(args, rank, dtype)
    par = Parallel(tp=tp, pp=pp, ep=ep, etp=1 if ep > 1 else None)
    modules, bridge = build_tiny_megatron(hf_dir, par, device=args.device, dtype=dtype)
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    pp_ranks: list = [None] * world
    dist.all_gather_object(pp_ranks, pp_rank)
    stage = [r for r in range(world) if pp_ranks[r] == pp_rank]

    full_tasks = bridge.get_conversion_tasks(modules)  # built once and reused, as verl's MegatronEngine does

    def full_stream():
        stream = bridge.export_hf_weights(modules, cpu=False, show_progress=False, conversion_tasks=full_tasks)
        return ((w.param_name, w.weight) for w in stream)

    exporter = StageExporter(modules, bridge, mode="auto")
    fallback = StageExporter(modules, bridge, mode="filter_full")

    # correctness: guarded local export vs full export vs checkpoint, on device tensors
    with stage_collective_guard(stage) as log:
        local = {n: t.detach().clone() for n, t in exporter.export()}
    full = {n: t.detach().clone() for n, t in full_stream()}
    device = next(iter(local.values())).device
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt", device=str(device)) as f:
        checkpoint = {n: f.get_tensor(n) for n in local}
        checkpoint_names = set(f.keys())
    filtered = {n: t.detach().clone() for n, t in fallback.export()}
    mine = {
        "rank": rank,
        "pp_rank": pp_rank,
        "stage": stage,
        "names": sorted(local),
        "vs_full": _mismatches(local, full),
        "vs_checkpoint": _mismatches(local, checkpoint, cast=True),
        "dtype_differs_from_checkpoint": sorted(n for n in local if local[n].dtype != checkpoint[n].dtype),
        "fallback_names_equal": sorted(filtered) == sorted(local),
        "vs_fallback": _mismatches(filtered, local),
        "in_stage_collectives": len(log.calls),
        "full_names": sorted(full),
    }
    del local, full, checkpoint, filtered

    # timing: fresh streams, nothing kept
    local_s, n_local, b_local = _timed(exporter.export, args.device, args.repeat)
    full_s, n_full, b_full = _timed(full_stream, args.device, args.repeat)
    filt_s, _, _ = _timed(fallback.export, args.device, args.repeat)
    mine.update(
        local_s=local_s, full_s=full_s, filter_full_s=filt_s, local_tensors=n_local, local_bytes=b_local,
        full_tensors=n_full, full_bytes=b_full,
    )  # fmt: skip

    reports: list = [None] * world
    dist.all_gather_object(reports, mine)
    ok = True
    if rank == 0:
        problems = []
        by_stage: dict[int, set[str]] = {}
        for r in reports:
            for key in ("vs_full", "vs_checkpoint", "vs_fallback"):
                if r[key]:
                    problems.append(f"rank {r['rank']}: {key} mismatches {r[key][:5]}")
            if not r["fallback_names_equal"]:
                problems.append(f"rank {r['rank']}: fallback yields other names")
            prev = by_stage.setdefault(r["pp_rank"], set(r["names"]))
            if prev != set(r["names"]):
                problems.append(f"rank {r['rank']}: ranks of stage {r['pp_rank']} disagree")
        full_names = set(reports[0]["full_names"])
        stages = list(by_stage.values())
        if set().union(*stages) != full_names or sum(map(len, stages)) != len(full_names):
            problems.append("stages do not partition the full export")
        if full_names != checkpoint_names:
            problems.append("full export names differ from the checkpoint")
        ok = not problems
        summary = {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "backend": dist.get_backend(),
            "world": world,
            "tp": tp,
            "pp": pp,
            "ep": ep,
            "arch": args.arch,
            "model": _model_config(args),
            "dtype": str(dtype),
            "ok": ok,
            "problems": problems,
            "ranks": [
                {k: v for k, v in r.items() if k not in ("names", "full_names", "dtype_differs_from_checkpoint")}
                for r in reports
            ],
            "dtype_differs_from_checkpoint": sorted({n for r in reports for n in r["dtype_differs_from_checkpoint"]}),
        }
        print(
            f"\nPP-local export check on {summary['device']} x{world} ({summary['backend']}), {args.arch} "
            f"hidden {args.hidden} layers {args.layers}, TP={tp} PP={pp} EP={ep}, {summary['dtype']}"
        )
        head = ("rank", "pp", "tensors", "MB", "local s", "full s", "filter s", "speedup")
        print("{:>4} {:>3} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8}".format(*head))
        for r in reports:
            med_l, med_f = statistics.median(r["local_s"]), statistics.median(r["full_s"])
            print(
                f"{r['rank']:>4} {r['pp_rank']:>3} {r['local_tensors']:>4}/{r['full_tensors']:<3} "
                f"{r['local_bytes'] / 2**20:>9.1f} {med_l:>9.4f} {med_f:>9.4f} "
                f"{statistics.median(r['filter_full_s']):>9.4f} {med_f / max(med_l, 1e-9):>7.2f}x"
            )
        print("RESULT:", "OK (local == full == checkpoint, stages partition the export)" if ok else "FAILED")
        for p in problems:
            print("  ", p)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(summary, indent=2))
    flag = [ok]
    dist.broadcast_object_list(flag, src=0)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if flag[0] else 1


if __name__ == "__main__":
    sys.exit(main())

"""`verl-p2p bench`: one trainer source pushes a synthetic >= 1 GB Qwen3-MoE into 2 engines x 2 ranks of
receiver processes over Mooncake (loopback tcp by default), and replays the very same write lists without
the replica (raw Mooncake: same slots, same remote ranges, same lanes, same slot flow control) in the same
run, alternating with the pushes, so the two are compared side by side on a noisy machine.

Reported: bytes per target, push seconds (HF stream + staging + replica loads + writes, as the trainer pays
them), raw write seconds, push_over_raw (median of the per-pair ratios, and best push over best raw;
goal <= 1.25), and the source's peak staging memory over the bytes of its two slots, staging_over_slots
(goal <= 1.10): the peak bytes of streamed HF tensors still alive (weak references: whoever holds them) plus
the slots; the replica loads straight into the slots. The process's RSS growth during the pushes is given
as a cross-check (it would show temporaries of SGLang's loaders or Mooncake).

A broadcast baseline runs in the same loop: the full HF checkpoint packed into the same slots and written
to every target rank over the same transport (what a ring/broadcast backend moves: each rank receives the
whole model and converts it itself). `p2p_speedup_vs_broadcast` is broadcast seconds over push seconds
(goal >= 0.8 x ranks per engine). `--device cpu|cuda` runs the conversion bench instead (`bench_convert`).
torch, SGLang and Mooncake are imported once the options parsed (`--help` answers at once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence

from verl_p2p.cli.bench_model import MODELS, BenchShape, SyntheticStream, model_shape, numel
from verl_p2p.cli.help import parser as command_parser
from verl_p2p.cli.quiet import run_quietly
from verl_p2p.planning.targets import TargetRank
from verl_p2p.transfer.replay import raw_replay
from verl_p2p.transfer.writer import WriteEntry, Writer


class RecordingWriter(Writer):
    """A Writer that keeps every submitted write list, so the same bytes can be replayed raw."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: list[list[WriteEntry]] = []

    def submit(self, entries):
        entries = list(entries)
        self.recorded.append(entries)
        return super().submit(entries)


class RssSampler:
    """Peak resident memory of this process while running (a cross-check on the staging accounting: it sees
    any temporary the replica, SGLang's loaders or Mooncake allocate)."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s = period_s
        self.peak = self.baseline = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> RssSampler:
        self.baseline = self.peak = _rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _broadcast_once(
    stream: SyntheticStream, buffers, writer: Writer, targets: Sequence[TargetRank], flush_bytes: int
) -> float:
    """A broadcast backend's move over the same transport and slots: every HF tensor's bytes packed into the
    slots in checkpoint order and written to every target rank, with the push's slot flow control."""
    import torch

    from verl_p2p.transfer.buffers import ALIGN

    start = time.perf_counter()
    buffers.begin()
    slot, fill, entries, unsent, failures = None, 0, [], 0, []

    def flush() -> None:
        nonlocal entries, unsent
        if slot is not None and entries:
            slot.track(writer.submit(entries))
        entries, unsent = [], 0

    for name, tensor in stream:
        src = tensor.contiguous().reshape(-1).view(torch.uint8)
        for offset in range(0, src.numel(), buffers.slot_bytes):
            n = min(buffers.slot_bytes, src.numel() - offset)
            at = -(-fill // ALIGN) * ALIGN
            if slot is None or at + n > slot.nbytes:
                flush()
                slot, lost = buffers.next_slot()
                failures += lost
                at = 0
            fill = at + n
            view = slot.view(at, n)
            view.copy_(src[offset : offset + n])
            entries += [WriteEntry(t, name, offset, view.data_ptr(), n) for t in targets]
            unsent += n
            if unsent >= flush_bytes:
                flush()
    flush()
    failures += buffers.drain()
    elapsed = time.perf_counter() - start
    if failures:
        raise RuntimeError(f"broadcast failed: {[f.describe() for f in failures]}")
    return elapsed


def run_bench(
    out_path: str | None = None,
    shape: BenchShape | None = None,
    slot_mb: int = 512,
    engines: int = 2,
    tp_size: int = 2,
    ep_size: int = 2,
    repeats: int = 3,
    protocol: str = "tcp",
    hostname: str = "127.0.0.1",
    timeout_s: float = 120.0,
    verify: bool = True,
    executor: str = "compiled",
    broadcast: bool = True,
    argv: Sequence[str] | None = None,
) -> dict:
    """Run the benchmark and return (and write to `out_path`, if given) its numbers."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()
    import torch

    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica.compiled import make_executor
    from verl_p2p.replica.stream import RankReplica
    from verl_p2p.sandbox.tiny import hf_tensor_shapes
    from verl_p2p.trainer.push import PushTarget, push
    from verl_p2p.transfer.buffers import TransferBuffers
    from verl_p2p.transfer.mooncake import MooncakeTransport
    from verl_p2p.transfer.receiver import spec_from_plan, start_receivers, stop_all

    shape = shape or BenchShape()
    cfg = shape.config()
    specs = {n: (tuple(s), torch.bfloat16) for n, s in hf_tensor_shapes(cfg)}
    model_bytes = sum(numel(s) * 2 for s, _ in specs.values())
    server_args = {"tp_size": tp_size, "ep_size": ep_size, "dtype": "bfloat16"}
    t0 = time.perf_counter()
    replicas = [
        RankReplica.build(cfg, server_args, layout_from_server_args(server_args, r), specs) for r in range(tp_size)
    ]
    build_s = time.perf_counter() - t0
    targets_of = {TargetRank(e, r): replicas[r] for e in range(engines) for r in range(tp_size)}
    executors = [make_executor(rep, executor) for rep in replicas]
    specs_of = {f"{t.engine}.{t.rank}": spec_from_plan(rep.plan.params) for t, rep in targets_of.items()}
    if broadcast:  # one more receiver per target rank, holding the whole HF checkpoint
        hf_spec = {n: (numel(s), str(d).removeprefix("torch.")) for n, (s, d) in specs.items()}
        specs_of.update({f"b{t.engine}.{t.rank}": hf_spec for t in targets_of})
    handles = start_receivers(specs_of, hostname=hostname, protocol=protocol)
    transport = buffers = writer = bwriter = None
    try:
        receivers = {t: handles[f"{t.engine}.{t.rank}"] for t in targets_of}
        targets = [PushTarget(t, executors[t.rank], receivers[t].remote_info()) for t in sorted(targets_of)]
        transport = MooncakeTransport(hostname, protocol=protocol, timeout_s=timeout_s)
        buffers = TransferBuffers(slot_mb << 20, transport)
        writer = RecordingWriter(transport, {t.target: t.remote for t in targets}, timeout_s=timeout_s)
        if broadcast:
            bremote = {t: handles[f"b{t.engine}.{t.rank}"].remote_info() for t in targets_of}
            bwriter = Writer(transport, bremote, timeout_s=timeout_s)
        stream = SyntheticStream(specs)
        for slot in buffers.slots:
            slot.tensor.zero_()  # resident before the baseline: the slots are counted on their own
        runs, broadcast_s = [], []
        flush_bytes = max(256, buffers.slot_bytes // 8)
        with RssSampler() as rss:
            push(iter(stream), targets, buffers, writer)  # warm-up (connections, page faults); records the writes
            if broadcast:
                _broadcast_once(stream, buffers, bwriter, sorted(bremote), flush_bytes)  # warm-up
            for _ in range(repeats):  # raw replay of the last push's write lists, a push, a broadcast: side by side
                recorded, writer.recorded = writer.recorded, []
                slots = [(x.addr, x.addr + x.nbytes) for x in buffers.slots]
                raw_s = raw_replay(writer, recorded, slots)
                writer.recorded = []  # the replay's own submits are not part of the next push
                runs.append((push(iter(stream), targets, buffers, writer), raw_s))
                if broadcast:
                    broadcast_s.append(_broadcast_once(stream, buffers, bwriter, sorted(bremote), flush_bytes))
        verified = _verify(stream, targets_of, receivers) if verify else None
        if verify and broadcast:
            verified = verified and _verify_broadcast(stream, [handles[f"b{t.engine}.{t.rank}"] for t in targets_of])
    finally:
        for w in (writer, bwriter):
            if w is not None:
                w.close()
        if buffers is not None:
            buffers.release()
        stop_all(handles.values())

    push_s = [m.seconds_total for m, _ in runs]
    raw_s = [r for _, r in runs]
    last = runs[-1][0]
    slot_bytes = last.slot_bytes
    peak_staged = max(m.peak_staged_bytes for m, _ in runs)
    result = {
        "model_bytes": model_bytes,
        "engines": engines,
        "tp_size": tp_size,
        "ep_size": ep_size,
        "protocol": protocol,
        "slot_bytes": slot_bytes // 2,
        "bytes_per_target": {f"e{t.engine}r{t.rank}": n for t, n in sorted(last.bytes_per_target.items())},
        "total_bytes_written": last.total_bytes,
        "bytes_loaded": last.loaded_bytes,
        "num_batches": last.num_batches,
        "push_seconds": push_s,
        "raw_seconds": raw_s,
        "push_seconds_median": statistics.median(push_s),
        "raw_seconds_median": statistics.median(raw_s),
        "push_over_raw": statistics.median(p / r for p, r in zip(push_s, raw_s, strict=True)),
        "push_over_raw_best": min(push_s) / min(raw_s),
        "push_gbps": last.total_bytes / statistics.median(push_s) / 1e9,
        "raw_gbps": last.total_bytes / statistics.median(raw_s) / 1e9,
        "phase_seconds": {
            "hf_wait": last.seconds_hf_wait,
            "stage": last.seconds_stage,
            "load": last.seconds_load,
            "write_wait": last.seconds_write_wait,
        },
        "peak_staged_bytes": peak_staged,
        "staging_bytes": peak_staged + slot_bytes,
        "staging_over_slots": (peak_staged + slot_bytes) / slot_bytes,
        "rss_growth_bytes": rss.peak - rss.baseline,
        "staging_over_slots_rss": (max(0, rss.peak - rss.baseline) + slot_bytes) / slot_bytes,
        "replica_build_seconds": build_s,
        "executor": executor,
        "verified": verified,
        "goals": {"push_over_raw": 1.25, "staging_over_slots": 1.10, "p2p_speedup_vs_broadcast": 0.8 * tp_size},
    }
    if argv is not None:
        result["command"] = " ".join(["verl-p2p", "bench", *argv])
    if broadcast:
        result.update(
            broadcast_bytes_written=model_bytes * len(targets_of),
            broadcast_seconds=broadcast_s,
            broadcast_seconds_median=statistics.median(broadcast_s),
            broadcast_gbps=model_bytes * len(targets_of) / statistics.median(broadcast_s) / 1e9,
            p2p_speedup_vs_broadcast=statistics.median(b / p for b, p in zip(broadcast_s, push_s, strict=True)),
        )
    print(format_table(result))
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _verify(stream: SyntheticStream, targets_of, receivers) -> bool:
    """Every receiver byte equals the replica's bytes for the same synthetic checkpoint (digests)."""
    import hashlib

    import torch

    want_by_key = {}
    for t, replica in targets_of.items():
        if replica.key not in want_by_key:
            want = {}
            for name, p in replica.plan.params.items():
                dst = torch.empty(p.nbytes, dtype=torch.uint8)
                replica.load(name, {n: stream.tensor(n) for n in p.feeds}, dst)
                want[name] = hashlib.blake2b(dst.numpy(), digest_size=16).hexdigest()
            want_by_key[replica.key] = want
        got = receivers[t].digest()
        if got != want_by_key[replica.key]:
            bad = sorted(n for n in got if got[n] != want_by_key[replica.key].get(n))
            raise RuntimeError(f"{t}: received bytes differ from the replica's for {bad[:5]}")
    return True


def _verify_broadcast(stream: SyntheticStream, handles) -> bool:
    """Every broadcast receiver holds every HF tensor's bytes."""
    import hashlib

    import torch

    want = {
        n: hashlib.blake2b(t.contiguous().reshape(-1).view(torch.uint8).numpy(), digest_size=16).hexdigest()
        for n, t in stream
    }
    for h in handles:
        got = h.digest()
        bad = sorted(n for n in want if got.get(n) != want[n])
        if bad:
            raise RuntimeError(f"broadcast receiver {h.name}: bytes differ for {bad[:5]}")
    return True


def format_table(r: dict) -> str:
    gb = 1e9
    rows = [
        ("model (bf16)", f"{r['model_bytes'] / gb:.2f} GB"),
        ("executor", r.get("executor", "sglang")),
        (
            "targets",
            f"{r['engines']} engines x {r['tp_size']} ranks (tp{r['tp_size']} ep{r['ep_size']}, {r['protocol']})",
        ),
        *((f"bytes -> {k}", f"{v / gb:.3f} GB") for k, v in r["bytes_per_target"].items()),
        ("bytes written / loaded", f"{r['total_bytes_written'] / gb:.2f} GB / {r['bytes_loaded'] / gb:.2f} GB"),
        (
            "push seconds (median)",
            f"{r['push_seconds_median']:.3f}  ({', '.join(f'{x:.3f}' for x in r['push_seconds'])})",
        ),
        (
            "raw write seconds (median)",
            f"{r['raw_seconds_median']:.3f}  ({', '.join(f'{x:.3f}' for x in r['raw_seconds'])})",
        ),
        (
            "push_over_raw (goal <= 1.25)",
            f"{r['push_over_raw']:.3f} median of pairs, {r['push_over_raw_best']:.3f} best/best",
        ),
        ("push / raw GB/s", f"{r['push_gbps']:.2f} / {r['raw_gbps']:.2f}"),
        ("phases (last push)", ", ".join(f"{k} {v:.3f}s" for k, v in r["phase_seconds"].items())),
        ("slots", f"2 x {r['slot_bytes'] / 2**20:.0f} MiB"),
        ("peak staged HF tensors", f"{r['peak_staged_bytes'] / 2**20:.1f} MiB"),
        ("staging_over_slots (goal <= 1.10)", f"{r['staging_over_slots']:.3f}"),
        (
            "process RSS growth during pushes",
            f"{r['rss_growth_bytes'] / 2**20:.1f} MiB (-> {r['staging_over_slots_rss']:.3f})",
        ),
        ("receiver bytes verified", str(r["verified"])),
    ]
    if "p2p_speedup_vs_broadcast" in r:
        rows[-1:-1] = [
            (
                "broadcast seconds (median)",
                f"{r['broadcast_seconds_median']:.3f}  ({', '.join(f'{x:.3f}' for x in r['broadcast_seconds'])}), "
                f"{r['broadcast_bytes_written'] / gb:.2f} GB",
            ),
            (
                f"p2p_speedup_vs_broadcast (goal >= {r['goals']['p2p_speedup_vs_broadcast']:.1f})",
                f"{r['p2p_speedup_vs_broadcast']:.3f}",
            ),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("verl-p2p bench", __doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_p2p.json", help="write the JSON result here")
    parser.add_argument(
        "--slot-mb", type=int, default=512, help="one transfer slot in MiB (two per source; p2p's bucket_size_mb)"
    )
    parser.add_argument("--engines", type=int, default=2, help="rollout engines receiving the push")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per engine")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size of each engine (divides --tp)")
    parser.add_argument("--model", default="bench", choices=MODELS, help="synthetic model shape")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (default: the model's: 24 bench, 4 qwen3-30b-a3b, 2 tiny)",
    )
    parser.add_argument("--experts", type=int, default=None, help="routed experts per layer (default: the model's)")
    parser.add_argument("--repeats", type=int, default=3, help="push / raw / broadcast rounds after a warm-up")
    parser.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"), help="Mooncake transport")
    parser.add_argument("--hostname", default="127.0.0.1", help="address the source and the receivers use")
    parser.add_argument("--no-verify", action="store_true", help="skip the byte checks")
    parser.add_argument(
        "--executor",
        default="compiled",
        choices=("compiled", "sglang"),
        help="how HF tensors become a rank's bytes: compiled write plans, or SGLang's load_weights (docs/options.md)",
    )
    parser.add_argument("--no-broadcast", action="store_true", help="skip the broadcast baseline")
    parser.add_argument(
        "--device",
        default=None,
        help="cpu or cuda[:N]: run the conversion bench (both executors, HF tensors on this device) instead "
        "(default: none, the push bench)",
    )
    parser.add_argument(
        "--slots",
        default=None,
        help="conversion bench slot kinds, comma list of gpu,pinned,host (default: gpu,pinned on cuda, host on cpu)",
    )
    parser.add_argument("--no-stage", action="store_true", help="conversion bench: skip the push-without-wire runs")
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="conversion bench: also FP8 targets (128x128 block FP8, the quantize step included) beside bf16",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show third-party output instead of logging it")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_quietly("bench", args.verbose, lambda: _main(args, argv))


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    shape = model_shape(args.model, args.layers, args.experts)
    if args.device is not None:
        from verl_p2p.cli.bench_convert import run_convert_bench

        run_convert_bench(
            device=args.device,
            shape=shape,
            tp_size=args.tp,
            ep_size=args.ep,
            slot_mb=args.slot_mb,
            repeats=args.repeats,
            slot_kinds=args.slots.split(",") if args.slots else None,
            stage=not args.no_stage,
            verify=not args.no_verify,
            out_path=args.out,
            argv=argv,
            fp8=args.fp8,
        )
        return 0
    run_bench(
        out_path=args.out,
        shape=shape,
        slot_mb=args.slot_mb,
        engines=args.engines,
        tp_size=args.tp,
        ep_size=args.ep,
        repeats=args.repeats,
        protocol=args.protocol,
        hostname=args.hostname,
        verify=not args.no_verify,
        executor=args.executor,
        broadcast=not args.no_broadcast,
        argv=argv,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

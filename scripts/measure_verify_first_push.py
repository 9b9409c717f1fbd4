"""What `verify_first_push` costs: the first push of a plan generation with and without the check.

With the compiled executor, the first push of each plan generation also loads every parameter through SGLang's
loader (the reference executor) and compares the bytes before they are sent. This runs the trainer's whole data
plane without the wire (`push()` into a transport that discards the writes, as `verl-p2p bench --device ...` does
for `stage_gbps`) over every rank of one engine, alternating pushes with the check armed and without, the copy
programs compiled beforehand (so only the check differs), and reports the medians and their difference.

    PYTHONPATH=$PWD .venv/bin/python scripts/measure_verify_first_push.py --device cpu \
        --out docs/measurements/verify_first_push_cpu.json
    PYTHONPATH=$PWD .venv/bin/python scripts/measure_verify_first_push.py --smoke   # seconds, for CI
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="where the HF tensors and transfer slots live (cpu, cuda)")
    p.add_argument("--model", default="bench", choices=("bench", "qwen3-30b-a3b", "tiny"), help="synthetic model")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--slot-mb", type=int, default=512, help="one transfer slot (two per source)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON result path")
    p.add_argument("--smoke", action="store_true", help="tiny model, one repeat: checks the script runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.repeats, args.slot_mb = "tiny", 1, 4
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()
    from verl_p2p.cli.bench_convert import DiscardTransport, hf_tensors, stage_once
    from verl_p2p.cli.bench_model import model_shape
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica.compiled import CompiledReplica
    from verl_p2p.replica.stream import RankReplica
    from verl_p2p.sandbox.tiny import hf_tensor_shapes
    from verl_p2p.transfer.buffers import TransferBuffers

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = model_shape(args.model, args.layers).config()
    specs = {n: (tuple(s), torch.bfloat16) for n, s in hf_tensor_shapes(cfg)}
    server_args = {"tp_size": args.tp, "ep_size": args.ep, "dtype": "bfloat16"}
    layouts = [layout_from_server_args(server_args, r) for r in range(args.tp)]
    references = [RankReplica.build(cfg, server_args, lay, specs) for lay in layouts]
    executors = [CompiledReplica(r) for r in references]
    hf = hf_tensors(specs, device)
    slot_device = device if device.type == "cuda" else torch.device("cpu")
    buffers = TransferBuffers(
        args.slot_mb << 20, DiscardTransport(), device=slot_device, pin_memory=device.type == "cuda"
    )
    if device.type == "cpu":
        torch.set_num_threads(1)  # as push() runs its loads on a CPU host
    seconds: dict[str, list[float]] = {"unchecked": [], "verified": []}
    try:
        stage_once(executors, hf, buffers, device)  # warm-up: compiles every program, first-touch pages
        for _ in range(args.repeats):
            for mode in ("verified", "unchecked"):  # side by side, so a noisy host hits both alike
                if mode == "verified":
                    for ex in executors:
                        ex.verify_next_push()
                t0 = time.perf_counter()
                stage_once(executors, hf, buffers, device)
                seconds[mode].append(time.perf_counter() - t0)
                if any(ex.verifying for ex in executors):
                    raise RuntimeError("a verified push left parameters unchecked")
    finally:
        buffers.release()
    target_bytes = sum(r.plan.nbytes for r in references)
    unchecked, verified = (statistics.median(seconds[m]) for m in ("unchecked", "verified"))
    result = {
        "command": " ".join(["scripts/measure_verify_first_push.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "sglang": __import__("sglang").__version__,
        "torch_threads": torch.get_num_threads(),
        "model": args.model,
        "layers": cfg["num_hidden_layers"],
        "tp_size": args.tp,
        "ep_size": args.ep,
        "params_per_source": sum(len(r.plan.params) for r in references),
        "target_bytes_per_source": target_bytes,
        "repeats": args.repeats,
        "seconds": seconds,
        "first_push_unchecked_s": unchecked,
        "first_push_verified_s": verified,
        "verify_overhead_s": verified - unchecked,
        "verified_over_unchecked": verified / unchecked,
        "verify_overhead_s_per_gb": (verified - unchecked) / (target_bytes / 1e9),
    }
    print(
        f"{args.model} TP{args.tp}/EP{args.ep} on {result['device']}: {target_bytes / 1e9:.2f} GB per source, "
        f"first push {unchecked:.2f} s unchecked, {verified:.2f} s verified "
        f"(+{verified - unchecked:.2f} s, {verified / unchecked:.2f}x)"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()

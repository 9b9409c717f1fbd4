"""Compare the replica's bytes for every rank with the witness dumps.

`compare_jobs(spec_paths)` runs under the SGLang installed in this process; run as
`python tests/support/replica_compare.py SPEC.json...` it prints `RESULTS <json>`. A job's witness dumps are in
SPEC's out/WITNESS (its `witness` key, else its tag). For each job and rank:
RankReplica.build from the witness's resolved server args, every parameter loaded into a NaN-prefilled
buffer and compared bit for bit with the witness parameter, then produced again chunk by chunk
(load_chunk) and compared; the compiled executor (`CompiledReplica`) does the same, whole and chunked;
finally every HF tensor must land on some rank. A job with `"strided_feeds": true` also feeds every parameter
non-contiguous views of its HF tensors (transposed, or every other element of a wider tensor: what an export may
yield) to both executors, whole and chunked, and compares the same way. A job with `bf16_source` (an FP8
rollout) takes its feeds from that bf16 checkpoint
through the trainer's quantize step (`trainer/fp8_stream.py`), not from the FP8 files.
A job with `fusion_from_published` builds the replica from
the server args less the shared-experts fusion flag the witness ran with, deciding fusion from the witness's
parameters (`rollout_fusion_args`), and records the refusal of the replica the trainer would build alone.
A job with `shared_tp1_from_published` (a witness started with SGLANG_SHARED_EXPERT_TP1=1, which no server info
reports) builds the replica from what `rollout_shared_expert_args` reads of the witness's parameter sizes, and
records the shared expert's shapes in that replica and in the one the server info alone would give (or SGLang's
refusal of the latter).
"""

import json
import os
import sys


def strided(t):
    """The same values as `t` in a non-contiguous view: transposed storage, or every other element."""
    import torch

    if t.dim() >= 2 and t.shape[-1] > 1 and t.shape[-2] > 1:
        view = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    else:
        view = torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]
    assert torch.equal(view, t) and (t.numel() <= 1 or not view.is_contiguous())
    return view


def _strided_problems(rank, name, p, replica, executor, feeds, want) -> list[str]:
    """Both executors fed non-contiguous views, whole and chunked: the same bytes as SGLang's rank."""
    import torch

    feeds = {f: strided(t) for f, t in feeds.items()}
    problems = []
    ranges = replica.chunks(name, max(p.nbytes // 3, p.nbytes // max(p.shape[0], 1)))
    for which, loader in (("reference", replica), ("compiled", executor)):
        got = torch.full((p.numel,), float("nan"), dtype=p.dtype).view(torch.uint8)
        loader.load(name, feeds, got)
        if not torch.equal(got, want):
            problems.append(f"rank {rank} {name}: {which} executor from non-contiguous feeds differs")
        again = torch.full((p.numel,), float("nan"), dtype=p.dtype).view(torch.uint8)
        for off, n in ranges:
            loader.load_chunk(name, feeds, off, again[off : off + n])
        if not torch.equal(again, want):
            problems.append(f"rank {rank} {name}: chunked {which} load from non-contiguous feeds differs")
    return problems


def _shared_gate_up_shapes(plan, suffix: str) -> list[tuple]:
    return [tuple(p.shape) for n, p in plan.params.items() if n.endswith(suffix)]


def _compare_job(job: dict, world: int, out: str) -> dict:
    import sglang
    import torch
    from safetensors.torch import load_file

    from verl_p2p.errors import UnsupportedLayoutError
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.planning.shared_experts import (
        DISABLE,
        ENFORCE,
        SHARED_GATE_UP,
        SHARED_TP1,
        SharedExpertsFusionMismatchError,
        check_replica_fusion,
        rollout_fusion_args,
        rollout_shared_expert_args,
    )
    from verl_p2p.replica import RankReplica, check_hf_coverage
    from verl_p2p.replica.compiled import CompiledReplica
    from verl_p2p.sandbox.tiny import hf_tensor_shapes

    out = os.path.join(out, job.get("witness", job["tag"]))  # a shared build names its witnesses by content
    info = json.load(open(os.path.join(out, "server_info.json")))
    cfg = json.load(open(os.path.join(job["model_path"], "config.json")))
    tensors = load_file(os.path.join(job["model_path"], "model.safetensors"))
    specs = {n: (tuple(s), tensors[n].dtype) for n, s in hf_tensor_shapes(cfg)}
    if "bf16_source" in job:  # FP8 rollout: the feeds are the trainer's bf16 tensors through the quantize step
        from verl_p2p.quant.block_fp8 import scale_name
        from verl_p2p.trainer.fp8_stream import quantized_stream

        scales = [scale_name(n) for n in specs if scale_name(n) in tensors]
        specs.update({n: (tuple(tensors[n].shape), torch.float32) for n in scales})
        source = load_file(os.path.join(job["bf16_source"], "model.safetensors"))
        tensors = dict(quantized_stream(source.items(), specs))
    problems, plans, checked, chunked, compiled, compiled_chunked, fallbacks = [], [], 0, 0, 0, 0, []
    strided_checked = 0
    derived, local, fusion_refusals = {}, {}, []
    shared_shapes, shared_tp1, shared_refusals = {"plain": [], "replica": []}, [], []
    for rank in range(world):
        witness = torch.load(os.path.join(out, f"rank{rank}.pt"))
        rank_info = info
        if job.get("fusion_from_published"):  # the server args without the fusion flag the witness ran with
            rank_info = {k: v for k, v in info.items() if k not in (DISABLE, ENFORCE)}
            plain = RankReplica.build(cfg, rank_info, layout_from_server_args(rank_info, rank), specs)
            try:  # the decision the trainer's own device would take must be refused against the rollout's
                check_replica_fusion(plain.plan.params, witness, f"witness rank {rank}")
            except SharedExpertsFusionMismatchError as exc:
                fusion_refusals.append(str(exc))
            rank_info = rollout_fusion_args(cfg, rank_info, witness, f"witness rank {rank}")
        if job.get("shared_tp1_from_published"):  # an environment setting no /server_info reports
            try:  # SGLang may refuse the split one outright (an FP8 shard under its 128-row block)
                plain = RankReplica.build(cfg, rank_info, layout_from_server_args(rank_info, rank), specs)
                shared_shapes["plain"] += _shared_gate_up_shapes(plain.plan, SHARED_GATE_UP)
            except UnsupportedLayoutError as exc:
                shared_refusals.append(str(exc))
            rank_info = rollout_shared_expert_args(
                cfg, rank_info, {n: t.numel() for n, t in witness.items()}, f"witness rank {rank}"
            )
            shared_tp1.append(rank_info.get(SHARED_TP1) is True)
        replica = RankReplica.build(cfg, rank_info, layout_from_server_args(rank_info, rank), specs)
        shared_shapes["replica"] += _shared_gate_up_shapes(replica.plan, SHARED_GATE_UP)
        check_replica_fusion(replica.plan.params, witness, f"witness rank {rank}")
        plans.append(replica.plan)
        derived[str(rank)] = list(replica.plan.derived)
        local[str(rank)] = list(replica.plan.local)
        executor = CompiledReplica(replica)
        fallbacks += [f"rank {rank} {n}: {why}" for n, why in executor.fallbacks.items()]
        published = [n for n in witness if n not in replica.plan.local]  # rollout-local: SGLang's own, unwritten
        if list(replica.plan.params) != published:
            problems.append(f"rank {rank}: names differ {sorted(set(replica.plan.params) ^ set(published))}")
            continue
        for name, p in replica.plan.params.items():
            expect = witness[name]
            if (tuple(expect.shape), expect.dtype) != (p.shape, p.dtype):
                problems.append(f"rank {rank} {name}: {p.shape}/{p.dtype} vs {tuple(expect.shape)}/{expect.dtype}")
                continue
            feeds = {f: tensors[f] for f in p.feeds}
            dst = torch.full((p.numel,), float("nan"), dtype=p.dtype).view(torch.uint8)
            replica.load(name, feeds, dst)
            want = expect.contiguous().view(-1).view(torch.uint8)
            if not torch.equal(dst, want):
                bad = int((dst.view(p.dtype) != want.view(p.dtype)).sum())
                problems.append(f"rank {rank} {name}: {bad} of {p.numel} elements differ")
                continue
            checked += 1
            fast = torch.full((p.numel,), float("nan"), dtype=p.dtype).view(torch.uint8)
            executor.load(name, feeds, fast)
            if not torch.equal(fast, want):
                bad = int((fast.view(p.dtype) != want.view(p.dtype)).sum())
                problems.append(f"rank {rank} {name}: compiled executor: {bad} of {p.numel} elements differ")
            compiled += 1
            ranges = replica.chunks(name, max(p.nbytes // 3, p.nbytes // max(p.shape[0], 1)))
            if len(ranges) > 1:
                for which, loader in (("replay", replica), ("compiled", executor)):
                    again = torch.full((p.numel,), float("nan"), dtype=p.dtype).view(torch.uint8)
                    for off, n in ranges:
                        loader.load_chunk(name, feeds, off, again[off : off + n])
                    if not torch.equal(again, want):
                        problems.append(f"rank {rank} {name}: chunked load ({which}) differs")
                chunked += 1
                compiled_chunked += 1
            if job.get("strided_feeds") and p.feeds:
                problems += _strided_problems(rank, name, p, replica, executor, feeds, want)
                strided_checked += 1
    try:
        check_hf_coverage(plans)
    except Exception as e:
        problems.append(f"coverage: {e}")
    return {
        "tag": job["tag"],
        "version": sglang.__version__,
        "checked": checked,
        "chunked": chunked,
        "compiled": compiled,
        "compiled_chunked": compiled_chunked,
        "fallbacks": fallbacks,
        "strided": strided_checked,
        "checkpoint_dtypes": sorted({str(t.dtype) for t in tensors.values()}),
        "rollout_dtypes": sorted({str(p.dtype) for plan in plans for p in plan.params.values()}),
        "problems": problems,
        "derived": derived,
        "local": local,
        "fusion_refusals": fusion_refusals,
        "shared_shapes": shared_shapes,
        "shared_tp1": shared_tp1,
        "shared_refusals": shared_refusals,
    }


def compare_jobs(spec_paths) -> list[dict]:
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()
    results = []
    for path in spec_paths:
        spec = json.load(open(path))
        for phase in spec["phases"]:
            for job in phase["jobs"]:
                results.append(_compare_job(job, phase["world"], spec["out"]))
    return results


if __name__ == "__main__":
    print("RESULTS " + json.dumps(compare_jobs(sys.argv[1:])))

"""Copy programs compiled from write plans (`verl_p2p.replica.program`): pure geometry checked against the
byte-range replay of the same recorded writes, on synthetic plans with every kind of write the replica
records (whole-tensor and strided copies, broadcast copies, constant fills), for every sub-range a transfer
slot can cut. Fast: no SGLang, no processes."""

from __future__ import annotations

import pytest
import torch

from verl_p2p.replica.compiled import run_program
from verl_p2p.replica.plan import ParamPlan, RecordedWrite, SourceView, WritePlan
from verl_p2p.replica.program import NotCompilable, compilable, compile_param
from verl_p2p.replica.stream import _replay

EXPERTS = 4


def _param(name, shape, writes, dtype=torch.float32):
    numel = 1
    for s in shape:
        numel *= s
    feeds = tuple(sorted({w.source.hf_name for w in writes if w.source is not None}))
    return ParamPlan(name, shape, dtype, numel * dtype.itemsize, feeds, tuple(writes))


def _copy(offset, shape, stride, hf, src_offset, src_shape, src_stride):
    return RecordedWrite("copy", offset, shape, stride, SourceView(hf, src_offset, src_shape, src_stride), feeds=(hf,))


@pytest.fixture(scope="module")
def case():
    """Experts (rows 0-1 of each from a whole HF tensor, row 2 from a column of another), a padded
    embedding (slice of rows + zero fill) and a broadcast copy."""
    specs = {}
    for e in range(EXPERTS):
        specs[f"a{e}"] = ((2, 8), torch.float32)
        specs[f"b{e}"] = ((8, 4), torch.float32)
    specs["c"] = ((5, 4), torch.float32)
    specs["d"] = ((4,), torch.float32)
    experts = _param(
        "experts",
        (EXPERTS, 3, 8),
        [_copy(e * 24, (2, 8), (8, 1), f"a{e}", 0, (2, 8), (8, 1)) for e in range(EXPERTS)]
        + [_copy(e * 24 + 16, (8,), (1,), f"b{e}", 1, (8,), (4,)) for e in range(EXPERTS)],
    )
    padded = _param(
        "padded",
        (5, 4),
        [_copy(0, (3, 4), (4, 1), "c", 4, (3, 4), (4, 1)), RecordedWrite("fill", 12, (2, 4), (4, 1), fill_value=0)],
    )
    broadcast = _param("broadcast", (3, 4), [_copy(0, (3, 4), (4, 1), "d", 0, (4,), (1,))])
    gen = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=gen) for n, (s, _) in specs.items()}
    return specs, hf, [experts, padded, broadcast]


def _replayed(p, hf, c0, c1):
    out = torch.full((c1 - c0,), float("nan"), dtype=p.dtype)
    flat = {n: t.reshape(-1) for n, t in hf.items()}
    for w in p.writes:
        src = None
        if w.op == "copy":
            s = w.source
            src = flat[s.hf_name].as_strided(s.shape, s.stride, s.offset).expand(w.shape)
        _replay(out, c0, c1, w.offset, w.shape, w.stride, src, w.fill_value)
    return out


def _whole_then_cut(p, hf, c0, c1):
    """The witness: every recorded write applied whole, through a strided view of the full parameter, then the
    range cut out; no clipping arithmetic at all (the replay shares its clipping idea with `program._clip`)."""
    out = torch.full((p.numel,), float("nan"), dtype=p.dtype)
    for w in p.writes:
        dst = out.as_strided(w.shape, w.stride, w.offset)
        if w.op == "copy":
            s = w.source
            dst.copy_(hf[s.hf_name].reshape(-1).as_strided(s.shape, s.stride, s.offset).expand(w.shape))
        else:
            dst.fill_(w.fill_value)
    return out[c0:c1].clone()


def _compiled(p, specs, hf, c0, c1):
    out = torch.full((c1 - c0,), float("nan"), dtype=p.dtype)
    run_program(compile_param(p, specs, c0, c1), hf, out)
    return out


def test_every_subrange_matches_the_whole_writes_cut_to_it_and_so_does_the_replay(case):
    specs, hf, params = case
    for p in params:
        n = p.numel
        for c0 in range(0, n, 3):
            for c1 in range(c0 + 1, n + 1, 5):
                want = _whole_then_cut(p, hf, c0, c1).view(torch.int32)
                got = _compiled(p, specs, hf, c0, c1)
                assert torch.equal(got.view(torch.int32), want), ("compiled", p.name, c0, c1)
                assert torch.equal(_replayed(p, hf, c0, c1).view(torch.int32), want), ("replay", p.name, c0, c1)
        assert not _compiled(p, specs, hf, 0, n).isnan().any()


def test_experts_are_batched_not_one_call_each(case):
    specs, _, (experts, padded, broadcast) = case
    prog = compile_param(experts, specs)
    assert prog.num_copies == 2 * EXPERTS and prog.launches == 2  # one batch per geometry
    whole = next(b for b in prog.copies if b.whole_sources)
    assert whole.hf_names == tuple(f"a{e}" for e in range(EXPERTS)) and whole.dst_step == 24
    assert compile_param(padded, specs).launches == 2  # one copy, one fill
    assert prog.strided_sources == frozenset(f"b{e}" for e in range(EXPERTS))


def test_strided_runs_of_one_source_merge_into_one_copy():
    """A loader that copies row by row from one tensor: one strided copy, not one per row."""
    specs = {"w": ((6, 4), torch.float32)}
    rows = [_copy(r * 8, (4,), (1,), "w", r * 4, (4,), (1,)) for r in range(6)]  # every other row of (12, 4)
    fill = [RecordedWrite("fill", r * 8 + 4, (4,), (1,), fill_value=1.5) for r in range(6)]
    p = _param("rows", (12, 4), rows + fill)
    prog = compile_param(p, specs)
    assert prog.launches == 2 and prog.num_copies == 1
    hf = {"w": torch.arange(24, dtype=torch.float32).reshape(6, 4)}
    assert torch.equal(_compiled(p, specs, hf, 0, 48), _replayed(p, hf, 0, 48))


@pytest.mark.parametrize(
    "write,reason",
    [
        (RecordedWrite("aten.mul_.Tensor", 0, (4,), (1,)), "aten.mul_.Tensor"),
        (RecordedWrite("copy", 0, (4,), (1,), None, feeds=("x",)), "intermediate tensor computed from ['x']"),
        (RecordedWrite("copy[torch.int32]", 0, (4,), (1,)), "torch.int32 view"),
        (RecordedWrite("fill", 0, (4,), (1,), fill_value=None), "tensor value"),
    ],
)
def test_non_compilable_writes_name_the_reason(write, reason):
    p = _param("p", (4,), [write])
    assert reason in compilable(p, {"x": ((4,), torch.float32)})
    with pytest.raises(NotCompilable, match="p: "):
        compile_param(p, {"x": ((4,), torch.float32)})


def test_dtype_conversion_copies_match_torch(case):
    """HF tensors in float32 into a bfloat16 parameter: the compiled copy rounds as copy_ does."""
    specs, hf, (experts, _, _) = case
    p = ParamPlan("bf16", experts.shape, torch.bfloat16, experts.numel * 2, experts.feeds, experts.writes)
    got = torch.empty(p.numel, dtype=torch.bfloat16)
    run_program(compile_param(p, specs), hf, got)
    want = _replayed(experts, hf, 0, experts.numel).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def _reinterpreting_plan():
    """A loader doing `param.copy_(w.view(torch.float16))` on a bfloat16 HF tensor, recorded by the capture's own
    recorder: the copy reinterprets bits (same element size), it does not convert values."""
    from verl_p2p.replica.plan import _WriteRecorder, validate_write_plan

    p = torch.nn.Parameter(torch.empty(4, 8, dtype=torch.float16, device="meta"), requires_grad=False)
    w = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    recorder = _WriteRecorder({"p": p}, {"w": w})
    with torch.no_grad(), recorder:
        p.data.copy_(w.view(torch.float16))
    plan = ParamPlan("p", (4, 8), torch.float16, 64, ("w",), tuple(recorder.writes["p"]))
    specs = {"w": ((4, 8), torch.bfloat16)}
    validate_write_plan(WritePlan({"p": plan}, specs))
    return plan, specs


def test_a_bit_reinterpreting_copy_is_recorded_replayed_as_bits_and_never_compiled():
    """The recorder keeps the view's dtype; the compiler refuses it (SGLang's loader serves it), the chunk replay
    reinterprets, and the cached plan keeps the dtype."""
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica.compiled import CompiledReplica
    from verl_p2p.replica.plan_cache import plan_from_json, plan_to_json
    from verl_p2p.replica.stream import RankReplica

    plan, specs = _reinterpreting_plan()
    (write,) = plan.writes
    assert write.source.dtype == torch.float16
    assert "through a torch.float16 view" in compilable(plan, specs)
    with pytest.raises(NotCompilable, match="torch.bfloat16"):
        compile_param(plan, specs)
    whole = WritePlan({"p": plan}, dict(specs))
    assert plan_from_json(plan_to_json(whole)) == whole
    hf = {"w": torch.randn(4, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)}
    want = hf["w"].view(torch.float16).reshape(-1).view(torch.uint8)  # what SGLang's loader holds
    ref = RankReplica({}, layout_from_server_args({}, 0), {}, whole, key=("reinterp",))
    executor = CompiledReplica(ref)
    assert "p" in executor.fallbacks
    for replica in (ref, executor):
        for offset in (0, 16, 48):
            dst = torch.zeros(16, dtype=torch.uint8)
            replica.load_chunk("p", hf, offset, dst)
            assert torch.equal(dst, want[offset : offset + 16]), (type(replica).__name__, offset)


def test_a_plan_of_another_float_type_of_the_same_size_is_refused():
    """A rank publishes numel and element size only: bfloat16 bytes into a float16 rollout would pass every size
    check. Parameters of another element size (a float32 norm in a bfloat16 model) are not refused."""
    from verl_p2p.replica.stream import ReplicaLoadError, check_plan_dtypes

    weight = _param("w", (4,), [_copy(0, (4,), (1,), "x", 0, (4,), (1,))], dtype=torch.bfloat16)
    norm = _param("norm", (4,), [_copy(0, (4,), (1,), "x", 0, (4,), (1,))], dtype=torch.float32)
    plan = WritePlan({"w": weight, "norm": norm}, {"x": ((4,), torch.float32)})
    for dtype in ("bfloat16", "auto", None, "float32"):
        check_plan_dtypes(plan, {"dtype": dtype})
    for dtype in ("float16", "half"):
        with pytest.raises(ReplicaLoadError, match=r"dtype=.*w \(torch.bfloat16\).*rebuild it"):
            check_plan_dtypes(plan, {"dtype": dtype})


def test_dtype_auto_is_resolved_from_the_checkpoint_the_rollout_serves(tmp_path, caplog):
    """`--dtype auto` resolves from the rollout's own checkpoint (SGLang's rule): a rollout started from a bfloat16
    copy of the float16 checkpoint the trainer plans from holds bfloat16, which no size check tells apart."""
    import json

    from verl_p2p.replica.stream import ReplicaLoadError, _sglang_auto_dtype, check_plan_dtypes

    fp16 = _param("w", (4,), [_copy(0, (4,), (1,), "x", 0, (4,), (1,))], dtype=torch.float16)
    plan = WritePlan({"w": fp16}, {"x": ((4,), torch.float32)})
    planned_config = {"model_type": "qwen3", "torch_dtype": "float16"}
    served = tmp_path / "bf16-copy"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"model_type": "qwen3", "torch_dtype": "bfloat16"}))
    args = {"dtype": "auto", "model_path": str(served)}
    with pytest.raises(ReplicaLoadError, match=r"dtype=auto from .*bf16-copy.*bfloat16.*float16.*rollout_model_path"):
        check_plan_dtypes(plan, args, planned_config)
    # the same resolution, though spelled differently (SGLang's rule: float32 checkpoints are served as float16)
    (served / "config.json").write_text(json.dumps({"model_type": "qwen3", "dtype": "float32"}))
    assert _sglang_auto_dtype({"model_type": "qwen3", "torch_dtype": "float32"}) == torch.float16
    check_plan_dtypes(plan, args, planned_config)
    (served / "config.json").write_text(json.dumps(planned_config))  # the same checkpoint config
    check_plan_dtypes(plan, args, planned_config)
    # a path this host cannot read: the plan's resolution, and one warning naming the fix
    caplog.set_level("WARNING")
    gone = {"dtype": "auto", "model_path": str(tmp_path / "elsewhere")}
    check_plan_dtypes(plan, gone, planned_config)
    check_plan_dtypes(plan, gone, planned_config)
    warned = [r for r in caplog.records if "cannot read" in r.getMessage()]
    assert len(warned) == 1 and "explicit dtype" in warned[0].getMessage()

"""The compiled executor in one process (installed SGLang): byte equality with the reference executor
(SGLang's own `load_weights`), whole and by slot-sized chunks, for id-encoded float32 and random bfloat16
checkpoints; the fallback for a parameter that cannot be compiled; the first-push verification.

Equality with SGLang's own distributed ranks, for every layout of the matrix and both SGLang releases, is in
test_replica_exact.py.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
from verl_p2p.sandbox.tiny import tiny_config_dict, tiny_state_dict

install_cpu_stubs()

from verl_p2p.replica import RankReplica  # noqa: E402
from verl_p2p.replica.compiled import CompiledPlanMismatchError, CompiledReplica, make_executor  # noqa: E402

# moe tp2/ep1: experts split by rows (gate/up) and columns (down); qwen2 tp2: padded vocab fill, tied lm_head
CASES = {
    "moe-tp2": ("qwen3_moe", dict(vocab_size=250), {"tp_size": 2, "ep_size": 1}),
    "qwen2-tp2": ("qwen2", dict(vocab_size=250, tie_word_embeddings=True), {"tp_size": 2}),
}
DTYPES = {"float32-ids": (torch.float32, True), "bfloat16-random": (torch.bfloat16, False)}


def _build(arch, overrides, args, dtype, id_encoded, ranks=None):
    cfg = tiny_config_dict(arch, **overrides)
    sd = tiny_state_dict(cfg, id_encoded=id_encoded, dtype=dtype)
    specs = {n: (tuple(t.shape), t.dtype) for n, t in sd.items()}
    args = {**args, "dtype": str(dtype).removeprefix("torch.")}
    ranks = range(args["tp_size"]) if ranks is None else ranks
    return sd, [RankReplica.build(cfg, args, layout_from_server_args(args, r), specs) for r in ranks]


def _nan_bytes(p) -> torch.Tensor:
    return torch.full((p.numel,), float("nan"), dtype=p.dtype).view(torch.uint8)


@pytest.fixture(scope="module")
def moe_bf16():
    return _build(*CASES["moe-tp2"], torch.bfloat16, False, ranks=[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_compiled_bytes_equal_reference(case, dtype):
    sd, replicas = _build(*CASES[case], *DTYPES[dtype])
    for ref in replicas:
        ex = CompiledReplica(ref)
        assert not ex.fallbacks
        for name, p in ref.plan.params.items():
            feeds = {f: sd[f] for f in p.feeds}
            want, got = _nan_bytes(p), _nan_bytes(p)
            ref.load(name, feeds, want)
            ex.load(name, feeds, got)
            assert torch.equal(got, want), f"rank {ref.layout.tp_rank} {name}"
            step = max(p.dtype.itemsize, (p.nbytes // 3) // p.dtype.itemsize * p.dtype.itemsize)
            chunked = _nan_bytes(p)
            for off in range(0, p.nbytes, step):  # slot-sized pieces cutting through rows and experts
                n = min(step, p.nbytes - off)
                ex.load_chunk(name, feeds, off, chunked[off : off + n])
            assert torch.equal(chunked, want), f"rank {ref.layout.tp_rank} {name} chunked"


def test_forced_fallback_is_exact_and_logged_once(moe_bf16, caplog):
    """A parameter whose recorded copy comes from an intermediate (not a view of an HF tensor) cannot be
    compiled: SGLang's loader produces it, the reason is logged once, and the bytes are still exact."""
    sd, (ref,) = moe_bf16
    name = "model.layers.1.mlp.experts.w13_weight"
    p = ref.plan.params[name]
    writes = (dataclasses.replace(p.writes[0], source=None),) + p.writes[1:]
    plan = dataclasses.replace(ref.plan, params={**ref.plan.params, name: dataclasses.replace(p, writes=writes)})
    forced = RankReplica(
        ref.server_args, ref.layout, ref.hf_config, plan, key=ref.key + ("forced",), ctx=ref.ctx, model=ref.model
    )
    with caplog.at_level(logging.WARNING, logger="verl_p2p.replica.compiled"):
        ex = CompiledReplica(forced)
        ex._log_fallbacks()  # the session keeps this executor for every later plan generation: not logged again
    assert list(ex.fallbacks) == [name] and "intermediate tensor" in ex.fallbacks[name]
    logged = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(logged) == 1 and "intermediate tensor" in logged[0]
    feeds = {f: sd[f] for f in p.feeds}
    want, got = _nan_bytes(p), _nan_bytes(p)
    ref.load(name, feeds, want)
    calls = []
    original = forced.load
    forced.load = lambda *a: (calls.append(a[0]), original(*a))[1]
    ex.load(name, feeds, got)
    assert calls == [name] and torch.equal(got, want)
    other = "model.layers.1.mlp.experts.w2_weight"  # still compiled: SGLang is not called for it
    ex.load(other, {f: sd[f] for f in plan.params[other].feeds}, _nan_bytes(plan.params[other]))
    assert calls == [name]


def test_first_push_verification_names_the_corrupted_tensor(moe_bf16):
    sd, (ref,) = moe_bf16
    ex = make_executor(ref, "compiled", verify_first_push=True)
    assert ex.verifying
    name = "model.layers.0.mlp.experts.w2_weight"
    p = ref.plan.params[name]
    prog = ex.program(name)
    batch = prog.copies[0]
    swapped = batch.hf_names[1:2] + batch.hf_names[:1] + batch.hf_names[2:]  # two experts trade places
    ex.programs[(name, 0, p.numel)] = dataclasses.replace(
        prog, copies=(dataclasses.replace(batch, hf_names=swapped),) + prog.copies[1:]
    )
    good = "model.layers.0.self_attn.qkv_proj.weight"
    ex.load(good, {f: sd[f] for f in ref.plan.params[good].feeds}, _nan_bytes(ref.plan.params[good]))
    with pytest.raises(CompiledPlanMismatchError) as err:
        ex.load(name, {f: sd[f] for f in p.feeds}, _nan_bytes(p))
    msg = str(err.value)
    assert f"parameter {name} of rollout rank 1" in msg and "executor=sglang" in msg
    # a chunked load is verified too: a corrupted chunk program is caught on its chunk
    ex.verify_next_push()
    feeds = {f: sd[f] for f in p.feeds}
    (first, n), *_ = ref.chunks(name, p.nbytes // 2)
    es = p.dtype.itemsize
    chunk = ex.program(name, 0, n // es)
    wrong = dataclasses.replace(chunk.copies[0], hf_names=tuple(reversed(chunk.copies[0].hf_names)))
    ex.programs[(name, 0, n // es)] = dataclasses.replace(chunk, copies=(wrong,) + chunk.copies[1:])
    with pytest.raises(CompiledPlanMismatchError, match=f"parameter {name} of rollout rank 1"):
        ex.load_chunk(name, feeds, first, _nan_bytes(p)[:n])


def test_verification_covers_one_push_only(moe_bf16):
    sd, (ref,) = moe_bf16
    ex = CompiledReplica(ref, verify_first_push=True)
    calls = []
    original = ref.load
    ref.load = lambda *a: (calls.append(a[0]), original(*a))[1]
    try:
        for _ in range(2):  # two pushes: only the first is checked against SGLang's loader
            for name, p in ref.plan.params.items():
                ex.load(name, {f: sd[f] for f in p.feeds}, _nan_bytes(p))
    finally:
        del ref.load
    assert sorted(calls) == sorted(ref.plan.params) and not ex.verifying


@pytest.mark.parametrize("offset,length", [(0, 64), (8, 56), (3, 13), (1, 2), (0, 1)])
def test_the_word_wise_compare_finds_every_differing_byte(offset, length):
    """The verification compares in 8/4/2-byte words where alignment allows: any single flipped byte, at any
    offset of a (possibly unaligned) slot view, is still a difference."""
    from verl_p2p.replica.compiled import _bytes_equal

    base = torch.arange(80, dtype=torch.uint8)
    a, b = base[offset : offset + length], base.clone()[offset : offset + length]
    assert _bytes_equal(a, b)
    for i in range(length):
        flipped = b.clone()
        flipped[i] ^= 0x40
        assert not _bytes_equal(a, flipped), i
    assert not _bytes_equal(a, b[:-1]) if length > 1 else True


def test_prepare_push_compiles_and_checks_every_program_before_any_push(moe_bf16):
    """Before the pause: every program a push runs (whole, and the chunks of a parameter larger than a slot) is
    compiled and checked against SGLang's loader on synthetic inputs; the push after it compiles and checks
    nothing. A corrupted program (two experts trading places) is caught there, naming the parameter."""
    sd, (ref,) = moe_bf16
    name = "model.layers.0.mlp.experts.w2_weight"
    p = ref.plan.params[name]
    slot = p.nbytes // 2  # this parameter (and the larger ones) go by chunks, the others whole
    ex = CompiledReplica(ref)
    checked = ex.prepare_push(slot)
    assert checked == len(ref.plan.params) and not ex.verifying
    es = p.dtype.itemsize
    assert {(name, o // es, (o + n) // es) for o, n in ref.chunks(name, slot)} <= set(ex.programs)
    compiled = set(ex.programs)
    calls = []
    original = ref.load
    ref.load = lambda *a: (calls.append(a[0]), original(*a))[1]
    try:  # the push itself: no compile, no check against SGLang's loader
        for param, q in ref.plan.params.items():
            feeds = {f: sd[f] for f in q.feeds}
            if q.nbytes > slot or not q.feeds:  # as push does
                for offset, n in ref.chunks(param, slot):
                    ex.load_chunk(param, feeds, offset, _nan_bytes(q)[offset : offset + n])
            else:
                ex.load(param, feeds, _nan_bytes(q))
    finally:
        del ref.load
    assert calls == [] and set(ex.programs) == compiled

    bad = CompiledReplica(ref)
    first, n = ref.chunks(name, slot)[0]
    chunk = bad.program(name, first // es, (first + n) // es)
    wrong = dataclasses.replace(chunk.copies[0], hf_names=tuple(reversed(chunk.copies[0].hf_names)))
    bad.programs[(name, first // es, (first + n) // es)] = dataclasses.replace(
        chunk, copies=(wrong,) + chunk.copies[1:]
    )
    with pytest.raises(CompiledPlanMismatchError, match=f"parameter {name} of rollout rank 1"):
        bad.prepare_push(slot)


def _restacked(sd: dict, layout: str) -> dict:
    """`sd` with each group of same-shaped tensors moved into shared buffers, as the FP8 quantizer returns its
    batches: the feeds are views at one constant step. "one-step": one buffer per group; "two-buffers": each
    group's tensors split over two buffers at an uneven point (where a quantizer batch ends); "swapped-middle": two
    middle views trade places, so the first and last addresses still fit one step and only a check of every
    address finds the break."""
    groups: dict = {}
    for name, t in sd.items():
        groups.setdefault((tuple(t.shape), t.dtype), []).append(name)
    out = {}
    for names in groups.values():
        order = list(names)
        if layout == "swapped-middle" and len(order) >= 4:
            order[1], order[2] = order[2], order[1]
        cut = len(order) * 2 // 5 if layout == "two-buffers" and len(order) >= 4 else len(order)
        for part in (order[:cut], order[cut:]):
            if part:
                out.update(zip(part, torch.stack([sd[n] for n in part]).unbind(0), strict=True))
    return out


@pytest.mark.parametrize("layout", ["one-step", "two-buffers", "swapped-middle"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sources_in_shared_buffers_take_one_copy_per_run_and_stay_exact(dtype, layout, monkeypatch):
    from verl_p2p.replica import compiled

    sd, replicas = _build(*CASES["moe-tp2"], *DTYPES[dtype])
    stacked_feeds = _restacked(sd, layout)
    runs = []
    real = compiled.stacked_runs

    def counting(b, srcs):
        found = real(b, srcs)
        runs.append((len(srcs), [v.shape[0] for _, v in found]))
        return found

    monkeypatch.setattr(compiled, "stacked_runs", counting)
    for ref in replicas:
        ex = CompiledReplica(ref)
        for name, p in ref.plan.params.items():
            want, got = _nan_bytes(p), _nan_bytes(p)
            ref.load(name, {f: sd[f] for f in p.feeds}, want)
            feeds = {f: stacked_feeds[f] for f in p.feeds}
            ex.load(name, feeds, got)
            assert torch.equal(got, want), f"rank {ref.layout.tp_rank} {name}"
            step = max(p.dtype.itemsize, (p.nbytes // 3) // p.dtype.itemsize * p.dtype.itemsize)
            chunked = _nan_bytes(p)
            for off in range(0, p.nbytes, step):  # slot-sized pieces cutting through experts
                n = min(step, p.nbytes - off)
                ex.load_chunk(name, feeds, off, chunked[off : off + n])
            assert torch.equal(chunked, want), f"rank {ref.layout.tp_rank} {name} chunked"
    whole_batches = [n for n, lengths in runs if lengths == [n]]
    split_batches = [n for n, lengths in runs if lengths and sum(lengths) < n or len(lengths) > 1]
    if layout == "one-step":
        assert whole_batches  # the experts' batches took one copy each
    elif layout == "two-buffers":
        assert split_batches  # a batch spanning both buffers: a run in each
    else:
        assert split_batches  # a batch with its middle out of step: runs around the break, the rest one by one


def test_adjacent_separate_tensors_are_not_read_as_one():
    """Sources one step apart in memory but each in its own storage: no view spans them, so they are copied one
    by one; a source out of step ends its run; sources all at one address make none."""
    import warnings

    from verl_p2p.replica.compiled import stacked_runs
    from verl_p2p.replica.program import CopyBatch

    batch = CopyBatch(("a", "b", "c"), (4,), (1,), (0, 4, 8), 4, None, ())
    views = list(torch.arange(12, dtype=torch.float32).reshape(3, 4).unbind(0))
    (start, stacked), *more = stacked_runs(batch, views)
    assert start == 0 and not more and torch.equal(stacked, torch.stack(views))
    memory = bytearray(48)
    with warnings.catch_warnings():  # frombuffer warns that a bytearray is writable
        warnings.simplefilter("ignore")
        separate = [torch.frombuffer(memory, dtype=torch.float32, count=4, offset=16 * i) for i in range(3)]
    assert [t.data_ptr() - separate[0].data_ptr() for t in separate] == [0, 16, 32]
    assert stacked_runs(batch, separate) == []
    (start, pair), *more = stacked_runs(batch, [views[0], views[2], views[1]])  # steps +2 rows, then -1 row
    assert start == 0 and not more and torch.equal(pair, torch.stack([views[0], views[2]]))  # the last: alone
    lone = torch.empty(4)
    assert stacked_runs(batch, [lone, lone, lone]) == []


def test_sources_of_mixed_dtypes_or_shapes_make_no_run():
    """A run is one view of one dtype and shape: one source of another dtype (or shape) makes none."""
    from verl_p2p.replica.compiled import stacked_runs
    from verl_p2p.replica.program import CopyBatch

    batch = CopyBatch(("a", "b", "c"), (4,), (1,), (0, 4, 8), 4, None, ())
    views = list(torch.arange(12, dtype=torch.float32).reshape(3, 4).unbind(0))
    assert stacked_runs(batch, [views[0], views[1].view(torch.int32), views[2]]) == []
    assert stacked_runs(batch, [views[0], views[1], torch.zeros(2, 2)]) == []


def test_missing_or_misshapen_feeds_are_refused_naming_the_tensor(moe_bf16):
    """The feed checks (expected shapes cached per program) still name what is wrong, on every call."""
    from verl_p2p.replica.stream import ReplicaLoadError

    sd, (ref,) = moe_bf16
    ex = CompiledReplica(ref)
    name, p = next((n, p) for n, p in ref.plan.params.items() if len(p.feeds) > 1)
    feeds = {f: sd[f] for f in p.feeds}
    dst = torch.empty(p.nbytes, dtype=torch.uint8)
    ex.load(name, feeds, dst)  # caches the program's expected shapes
    gone = p.feeds[-1]
    with pytest.raises(ReplicaLoadError, match=f"needs HF tensor {gone}, which was not given"):
        ex.load(name, {f: t for f, t in feeds.items() if f != gone}, dst)
    bent = {**feeds, gone: feeds[gone].reshape(-1)}
    with pytest.raises(ReplicaLoadError, match=f"HF tensor {gone} has shape .* the plan was built for"):
        ex.load(name, bent, dst)

"""The mem fraction the e2e gives its real SGLang servers: computed from the GPU at hand and the models' bytes (one
budget, `real_sizes.one_gpu_budget`), an explicit `--mem-fraction` winning, a run no fraction fits refused with
its numbers. Checked against SGLang's KV rule with the figures of two real runs on an 80 GB H100 (SGLang 0.5.12,
Qwen3-30B-A3B real widths at 8 layers): at 0.12 both servers died "Not enough memory", at 0.3 every check passed.
The GPU-memory reader is injected, so the argument resolution runs end to end on a CPU host."""

from __future__ import annotations

import pytest

from verl_p2p.e2e import run
from verl_p2p.e2e.real_sizes import GIB, budget_of, qwen3_30b_a3b, sglang_kv_room, usable_gpu_bytes

H100_BYTES = usable_gpu_bytes(81_559)  # nvidia-smi's memory.total of the H100 80GB HBM3 those runs had
E2E_SLOTS = 2 * (16 << 20)  # the e2e's two 16 MiB slots (--bucket-mb 16)
# SGLang's "avail mem" (GiB) at load begin / load end of each server in those runs (server_logs.tgz of both runs):
ROLLOUT = (65.91, 55.44)  # the rollout under test (the same in both runs)
FRESH_AT_03 = (40.20, 29.73)  # the fresh reference server, beside the rollout and the trainer, at 0.3
KV_POOL_GIB = 1.0  # "K size: 0.50 GB, V size: 0.50 GB": the e2e's 65,536-token cap at 8 layers


def _e2e(*argv: str, gpu_bytes: int | None = H100_BYTES):
    def read() -> int:
        if gpu_bytes is None:
            raise AssertionError("the GPU was read although --mem-fraction or the loopback needs no fraction")
        return gpu_bytes

    return run.parse_args(list(argv), read_gpu_bytes=read)


def test_qwen3_30b_a3b_at_8_layers_fits_an_80gb_gpu_by_sglangs_rule():
    """The budget admits 8 real-width layers with a fresh server on the H100 (the old one refused it: it charged the
    rollout its whole fraction, where the e2e's token cap holds it to weights + a 1 GiB pool), at a fraction whose
    KV room is positive for every server the real runs saw, where 0.12's was negative (their "Not enough
    memory")."""
    budget = budget_of(qwen3_30b_a3b(8), "bf16", gpu_bytes=H100_BYTES, slot_bytes=E2E_SLOTS)
    assert budget.fits and budget.servers == 2, budget.why
    assert budget.kv_min_bytes == KV_POOL_GIB * GIB
    mf = budget.mem_fraction
    assert 0.12 < mf <= 0.35
    # the budget's own worst case: the fresh server beside the trainer and the rollout gets its weights + pool
    free = budget.free_last_bytes / GIB
    assert sglang_kv_room(free, free - budget.server_weight_bytes / GIB, mf) >= KV_POOL_GIB
    assert sglang_kv_room(free, free - budget.server_weight_bytes / GIB, 0.12) < 0
    # the model is pessimistic against the real run: the fresh server found more free than the budget plans with
    assert free < FRESH_AT_03[0]
    for before, after in (ROLLOUT, FRESH_AT_03):
        assert sglang_kv_room(before, after, 0.12) < 0  # what killed both servers at the old default
        assert sglang_kv_room(before, after, mf) >= KV_POOL_GIB
    assert sglang_kv_room(*FRESH_AT_03, 0.3) >= KV_POOL_GIB  # the run that passed


def test_the_e2e_computes_its_fraction_from_the_gpu_and_records_it():
    args = _e2e("--rollout", "sglang", "--models", "qwen3_moe", "--size", "real", "--layers", "8")
    expected = budget_of(qwen3_30b_a3b(8), "bf16", gpu_bytes=H100_BYTES, slot_bytes=E2E_SLOTS).mem_fraction
    assert args.mem_fraction == expected > 0.12
    record = args.mem_fraction_record
    assert record["value"] == expected and record["source"] == "computed from the GPU"
    assert record["gpu_gib"] == round(H100_BYTES / GIB, 2) and record["budget"]["servers"] == 2
    # one server at a time: the fraction for the server alone beside the trainer, smaller
    alone = _e2e(
        "--rollout", "sglang", "--models", "qwen3_moe", "--size", "real", "--layers", "8", "--one-server-at-a-time"
    )
    assert alone.mem_fraction < expected and alone.mem_fraction_record["budget"]["servers"] == 1


def test_an_explicit_mem_fraction_wins_and_the_loopback_reads_no_gpu():
    explicit = _e2e("--rollout", "sglang", "--models", "qwen3_moe", "--size", "real", "--layers", "8",
                    "--mem-fraction", "0.3", gpu_bytes=None)  # fmt: skip
    assert explicit.mem_fraction == 0.3 and explicit.mem_fraction_record["source"] == "--mem-fraction"
    # explicit wins even where the budget would refuse (48 layers on the H100)
    deep = _e2e("--rollout", "sglang", "--models", "qwen3_moe", "--size", "real", "--layers", "48",
                "--mem-fraction", "0.9", gpu_bytes=None)  # fmt: skip
    assert deep.mem_fraction == 0.9
    loopback = _e2e("--models", "qwen3_moe", gpu_bytes=None)
    assert loopback.mem_fraction is None and loopback.mem_fraction_record["source"] == "unused (loopback rollout)"


def test_a_run_no_fraction_fits_is_refused_with_its_numbers(capsys):
    """48 real-width layers with a fresh server on an 80 GB GPU: refused before anything is written, naming the
    GPU's memory, the trainer's and the servers' GiB, and the ways out."""
    with pytest.raises(SystemExit) as exit_:
        _e2e("--rollout", "sglang", "--models", "qwen3_moe", "--size", "real", "--layers", "48", "--workdir", "/x")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--models qwen3_moe --size real at 48 layers does not fit on this GPU (78.2 GiB usable)" in err
    assert "after the trainer (" in err and "GiB are free, less than one server's weights + KV pool (" in err
    for fix in ("fewer --layers", "--one-server-at-a-time", "--fp8", "pass --mem-fraction"):
        assert fix in err
    with pytest.raises(SystemExit):
        _e2e("--rollout", "sglang", "--models", "qwen3_moe", "--mem-fraction", "1.5", gpu_bytes=None)
    assert "between 0 and 1" in capsys.readouterr().err


def test_help_says_the_default_is_computed_from_the_gpu(capsys):
    with pytest.raises(SystemExit):
        run.build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--mem-fraction-static of each real server (default: computed from the GPU" in text
    assert "the loopback rollout ignores it" in text

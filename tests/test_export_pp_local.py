"""PP-local export on real Megatron models (Megatron-Bridge, gloo): each stage yields exactly its own tensors.

One spawned process group per parallel layout builds every model once and checks, per rank:
- the stage's stream equals the bridge's full export for those names, and the HF checkpoint, bit for bit;
- it ran under `stage_collective_guard`, so any collective reaching another stage would have raised;
- the filtered fallback (`filter_full`) yields the same tensors;
and here, across ranks: the stages partition the full export (disjoint, union equal) with global layer numbers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open
from support.export_cases import ModelCase, add_mtp_tensors, run_cases

from verl_p2p.sandbox.cpu_megatron import Parallel, run_group
from verl_p2p.sandbox.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.slow


def _checkpoint_names(hf_dir: str) -> set[str]:
    with safe_open(str(Path(hf_dir) / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _expected_stage(name: str, cfg: dict, pp: int, vpp: int) -> int:
    """Megatron's standard layout, derived independently: layer chunks round-robin over stages."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer:
        per_chunk = cfg["num_hidden_layers"] // (pp * vpp)
        return (int(layer.group(1)) // per_chunk) % pp
    if name == "model.embed_tokens.weight":
        return 0
    assert name in ("model.norm.weight", "lm_head.weight") or name.startswith("mtp."), name
    return pp - 1


def _assert_stages_partition(case: ModelCase, reports: list) -> None:
    cfg = json.loads((Path(case.hf_dir) / "config.json").read_text())
    full = set(reports[0].full_names)
    assert full == _checkpoint_names(case.hf_dir), f"{case.label}: the full export is not the checkpoint"
    by_stage: dict[int, list[str]] = {}
    for rep in reports:
        where = f"{case.label} rank {rep.rank} (stage {rep.pp_rank})"
        assert rep.local_names, f"{where}: exported nothing"
        assert len(set(rep.local_names)) == len(rep.local_names), f"{where}: a tensor was yielded twice"
        assert not rep.local_vs_full_mismatch, f"{where}: differs from the full export: {rep.local_vs_full_mismatch}"
        assert not rep.local_vs_checkpoint_mismatch, f"{where}: differs from HF: {rep.local_vs_checkpoint_mismatch}"
        assert sorted(rep.filtered_names) == sorted(rep.local_names), f"{where}: fallback yields other names"
        assert not rep.filtered_vs_local_mismatch, f"{where}: fallback differs: {rep.filtered_vs_local_mismatch}"
        if case.par.tp == 1:
            assert rep.guard_ops == [], f"{where}: TP=1 PP-local export communicated: {rep.guard_ops}"
        else:  # the in-stage TP gathers are real collectives, inside the stage
            assert any(op == "all_gather" and len(r) == case.par.tp for op, r in rep.guard_ops), rep.guard_ops
            assert all(set(r) <= set(rep.stage_ranks) for _, r in rep.guard_ops)
        previous = by_stage.setdefault(rep.pp_rank, rep.local_names)
        assert previous == rep.local_names, f"{where}: ranks of one stage yield different streams"
    for a in by_stage:
        for b in by_stage:
            assert a == b or not set(by_stage[a]) & set(by_stage[b]), f"{case.label}: stages {a},{b} overlap"
    assert set().union(*map(set, by_stage.values())) == full, f"{case.label}: union of stages != full export"
    for stage, names in by_stage.items():
        wrong = [n for n in names if _expected_stage(n, cfg, case.par.pp, case.par.vpp or 1) != stage]
        assert not wrong, f"{case.label}: stage {stage} yields another stage's tensors (layer numbering?): {wrong}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    paths = {
        "dense": write_tiny_checkpoint(root / "dense", "qwen3"),
        "moe": write_tiny_checkpoint(root / "moe", "qwen3_moe"),
        "tied": write_tiny_checkpoint(root / "tied", "qwen3", tie_word_embeddings=True),
        "dense4": write_tiny_checkpoint(root / "dense4", "qwen3", num_hidden_layers=4),
        "mtp": add_mtp_tensors(write_tiny_checkpoint(root / "mtp", "qwen3")),
    }
    return {k: str(v) for k, v in paths.items()}


def _check_guard_fired(results: list) -> None:
    for rank, res in enumerate(results):
        assert "outside this pipeline stage" in res["guard_error"], f"rank {rank}: cross-stage broadcast not caught"


def test_pp2_each_stage_exports_its_own_tensors(checkpoints):
    cases = [
        ModelCase("dense", checkpoints["dense"], Parallel(pp=2)),
        ModelCase("moe", checkpoints["moe"], Parallel(pp=2)),
        ModelCase("tied", checkpoints["tied"], Parallel(pp=2)),
        ModelCase("vpp", checkpoints["dense4"], Parallel(pp=2, vpp=2)),
        ModelCase("mtp", checkpoints["mtp"], Parallel(pp=2)),
    ]
    results = run_group(run_cases, 2, cases, "verl_engine", timeout_s=300)
    for i, case in enumerate(cases):
        _assert_stages_partition(case, [res["reports"][i] for res in results])
    _check_guard_fired(results)
    tied = [res["reports"][2] for res in results]
    assert "lm_head.weight" not in tied[1].local_names, "tied: the last stage re-exported the embedding as lm_head"
    mtp_last = results[1]["reports"][4].local_names
    assert any(n.startswith("mtp.layers.0.") for n in mtp_last) and "model.embed_tokens.weight" not in mtp_last
    # verl's MegatronEngine class as the export source: same stream; QAT switches to the logged fallback
    for res in results:
        engine, dense = res["engine"], res["reports"][0]
        assert engine["mode"] == "pp_local" and engine["names"] == dense.local_names
        assert engine["fallback_mode"] == "filter_full" and "QAT" in engine["fallback_reason"]
        assert sorted(engine["fallback_names"]) == sorted(dense.local_names)


def test_tp2_pp2_stage_exports_and_fewer_targets_than_ranks(checkpoints):
    cases = [
        ModelCase("dense", checkpoints["dense"], Parallel(tp=2, pp=2)),
        ModelCase("moe_ep2", checkpoints["moe"], Parallel(tp=2, pp=2, ep=2, etp=1)),
        ModelCase("moe_etp2", checkpoints["moe"], Parallel(tp=2, pp=2)),
        ModelCase("tied", checkpoints["tied"], Parallel(tp=2, pp=2)),
    ]
    results = run_group(run_cases, 4, cases, "fewer_targets", timeout_s=420)
    for i, case in enumerate(cases):
        _assert_stages_partition(case, [res["reports"][i] for res in results])
    _check_guard_fired(results)
    # one rollout target, four trainer ranks: one sender per stage, the other rank of each stage drains;
    # the run finishing at all (run_group's timeout) is the no-hang check
    drives = [res["drive"] for res in results]
    assert [d["is_sender"] for d in drives] == [True, False, True, False]
    assert [d["senders"] for d in drives] == [(0,), (0,), (2,), (2,)]
    for d in drives:
        if d["is_sender"]:
            assert d["written"] == d["expected"] and d["written"] and not d["mismatch"], d
        else:
            assert d["written"] == [], d

"""`verl-p2p plan --gpu-mem`: a rollout rank's weights (from its write plan) and a trainer source's staging slots
against one GPU; a layout that cannot fit is refused with the numbers and the nearest layouts that do."""

from __future__ import annotations

import json

import pytest

from verl_p2p.cli import main as cli_main
from verl_p2p.sandbox.tiny import tiny_config_dict


@pytest.fixture(scope="module")
def wide_vocab(tmp_path_factory):
    """The tiny MoE with a 65536-token vocabulary: its embeddings and head (split over tp) dominate a rank."""
    path = tmp_path_factory.mktemp("wide") / "config.json"
    path.write_text(json.dumps(dict(tiny_config_dict("qwen3_moe"), vocab_size=65536)))
    return path


def test_a_layout_that_does_not_fit_is_refused_with_the_nearest_that_do(wide_vocab, tmp_path, capsys):
    common = ["plan", "--model", str(wide_vocab), "--trainer", "tp=1", "--bucket-mb", "1"]
    common += ["--plan-cache-dir", str(tmp_path / "plans")]
    assert cli_main([*common, "--rollout", "tp=2,ep=2x2", "--json"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    rank = roomy["memory"]["rollout_rank_bytes"]
    assert rank == max(roomy["target_bytes"].values()) and roomy["memory"]["trainer_staging_bytes"] == 2 << 20
    assert roomy["memory"]["fits"] and roomy["memory"]["gpu_mem_bytes"] == 80 * 10**9  # the default card

    gpu_gb = 0.8 * rank / 1e9  # the rank's weights are 1.25 x the card
    assert cli_main([*common, "--rollout", "tp=2,ep=2x2", "--gpu-mem", f"{gpu_gb:.6f}", "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "Traceback" not in out.err
    assert "--rollout tp=2,ep=2x2 does not fit" in out.err and "--gpu-mem" in out.err
    assert f"holds {rank / 1e6:.2f}MB of weights" in out.err
    assert "--rollout tp=4,ep=4 (" in out.err and "4 GPUs)" in out.err  # twice the tp, one engine: the same GPUs

    # that suggestion fits when planned
    assert cli_main([*common, "--rollout", "tp=4,ep=4", "--gpu-mem", f"{gpu_gb:.6f}"]) == 0
    text = capsys.readouterr().out
    assert "memory: a rollout rank holds" in text and "fits one" in text


def test_staging_larger_than_the_card_is_refused(wide_vocab, tmp_path, capsys):
    argv = ["plan", "--model", str(wide_vocab), "--trainer", "tp=1", "--rollout", "tp=2,ep=2", "--bucket-mb", "4096"]
    assert cli_main([*argv, "--gpu-mem", "4", "--plan-cache-dir", str(tmp_path / "plans")]) == 2
    assert "a trainer source stages 8.59GB (two --bucket-mb slots)" in capsys.readouterr().err
    assert cli_main([*argv, "--gpu-mem", "0"]) == 2
    assert "--gpu-mem must be positive" in capsys.readouterr().err

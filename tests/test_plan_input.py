"""`verl-p2p plan` never plans something other than what was asked: a missing or empty --model, a malformed toy
option, a pipeline split the model's layers refuse, a block-FP8 shard SGLang refuses, each answered in a few
lines naming the option and the fix (status 2), before any write plan is captured."""

from __future__ import annotations

import json

import pytest

from verl_p2p.cli import main as cli_main
from verl_p2p.planning.model_cards import model_card


@pytest.fixture
def no_capture(monkeypatch):
    """Any write-plan capture (or cache read) fails the test: the refusals must come before it."""
    import verl_p2p.replica.stream as stream

    def captured(*args, **kwargs):
        raise AssertionError("a write plan was captured before the refusal")

    monkeypatch.setattr(stream, "plan_rank", captured)


def _refused(capsys, argv: list[str]) -> str:
    assert cli_main(["plan", *argv]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "Traceback" not in out.err and "source 0" not in out.err
    assert len(out.err.strip().splitlines()) <= 6, out.err
    return out.err


@pytest.mark.parametrize(
    "argv",
    [
        ["--trainer", "tp=4,ep=8", "--rollout", "tp=8,ep=8x4"],
        ["--model", "", "--trainer", "tp=4,ep=8", "--rollout", "tp=8,ep=8x4"],
        ["--json"],
        ["--model", "  ", "--json"],
    ],
)
def test_no_model_plans_nothing_and_names_the_option_and_the_toy(capsys, argv):
    err = _refused(capsys, argv)
    assert "--model is" in err and "--model toy" in err and "qwen3-30b-a3b" in err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--engines", "2,x"], "--engines '2,x'"),
        (["--engines", ""], "--engines ''"),
        (["--engines", "2,0"], "--engines '2,0'"),
        (["--pp", "0"], "--pp 0"),
        (["--sources-per-stage", "-1"], "--sources-per-stage -1"),
        (["--trainer", "tp=2", "--json"], "--trainer, --json would be ignored"),
    ],
)
def test_malformed_toy_options_are_refused_by_name(capsys, argv, named):
    err = _refused(capsys, ["--model", "toy", *argv])
    assert named in err and ("Fix" in err or "e.g." in err)


def test_the_toy_plan_is_asked_for_by_name(capsys):
    assert cli_main(["plan", "--model", "toy", "--pp", "2", "--sources-per-stage", "1", "--engines", "1,1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["source 0 (pp 0): e0r0, e1r0", "source 1 (pp 1): e0r0, e1r0"]


def test_toy_options_beside_a_model_are_refused(capsys, no_capture):
    argv = ["--model", "qwen3-30b-a3b", "--trainer", "tp=4,ep=8", "--rollout", "tp=8,ep=8", "--pp", "2"]
    err = _refused(capsys, argv)
    assert "--pp: options of --model toy only" in err and "--trainer tp=,pp=" in err


def test_a_pipeline_split_the_layers_refuse_is_named_before_any_capture(capsys, no_capture):
    argv = ["--model", "deepseek-v3", "--trainer", "tp=8,pp=4,ep=8", "--rollout", "tp=8,ep=8", "--json"]
    err = _refused(capsys, argv)
    assert "--trainer pp=4" in err and "61 layers" in err and "1, 61" in err


def test_a_block_fp8_shard_sglang_refuses_is_named_from_the_config(capsys, tmp_path, no_capture):
    """Kimi-K2's widths at 32-way TP: the shared expert (2048) and the dense MLP (18432) leave 64- and 576-wide
    shards; named with the rollout option that holds each whole, and no Python object in the message."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(model_card("kimi-k2", 2)))
    argv = ["--model", str(path), "--rollout-quant", "fp8", "--trainer", "tp=8,ep=64,dp=32"]
    err = _refused(capsys, [*argv, "--rollout", "tp=32,ep=32"])
    assert "--rollout tp=32,ep=32" in err and "64-wide" in err and "576-wide" in err
    assert "shared_tp=1" in err and "moe_dense_tp=1" in err and "RankLayout(" not in err and "{" not in err
    # with both held whole, nothing of the rule is left to refuse (the capture is reached: the fixture fails it)
    assert cli_main(["plan", *argv, "--rollout", "tp=32,ep=32,moe_dense_tp=1,shared_tp=1", "--plan-cache-dir", ""])
    assert "captured before the refusal" in capsys.readouterr().out

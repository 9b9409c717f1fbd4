"""A cold `verl-p2p plan` captures one rank per rollout layout and one decoder layer per kind, and names the
rest: every figure it prints equals a capture of every rank at every layer (`--every-rank`)."""

from __future__ import annotations

import json

import pytest

from verl_p2p.cli import main as cli_main
from verl_p2p.planning.layer_sample import LayerSample, layer_kinds
from verl_p2p.planning.model_cards import model_card
from verl_p2p.sandbox.tiny import tiny_config_dict


def _plan(capsys, path, trainer: str, rollout: str, cache, *extra: str) -> dict:
    argv = ["plan", "--model", str(path), "--trainer", trainer, "--rollout", rollout, "--json"]
    assert cli_main([*argv, "--plan-cache-dir", str(cache), *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("model_type", "trainer", "rollout"),
    [
        ("qwen3_moe", "tp=2,pp=2,ep=2", "tp=2,ep=2x2"),  # 4 MoE layers: layer 0 captured, 1-3 named
        ("deepseek_v3", "tp=1,pp=2,dp=2", "tp=4,ep=4,dp_attn=2x2"),  # dense layer 0, MoE layer 1, 2-3 named
    ],
)
def test_the_shortcut_prints_what_a_capture_of_every_rank_at_every_layer_prints(
    tmp_path, capsys, model_type, trainer, rollout
):
    cfg = tiny_config_dict(model_type, num_hidden_layers=4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    fast = _plan(capsys, path, trainer, rollout, tmp_path / "fast")
    full = _plan(capsys, path, trainer, rollout, tmp_path / "full", "--every-rank")
    tp = int(rollout.split(",")[0].removeprefix("tp="))
    assert len(fast.pop("plans")) == 1 and len(full.pop("plans")) == tp  # one capture against tp of them
    assert fast == full
    stages = {link["pp_stage"] for link in full["links"]}
    assert stages == {0, 1}  # both stages carry bytes: the renamed layers landed on the second one


def test_layer_kinds_follow_sglangs_rules():
    qwen = dict(tiny_config_dict("qwen3_moe", num_hidden_layers=6), mlp_only_layers=[4], decoder_sparse_step=2)
    assert layer_kinds(qwen) == ["dense", "moe", "dense", "moe", "dense", "moe"]
    sample = LayerSample.of(qwen)
    assert (sample.kept, sample.source) == (2, (0, 1, 0, 1, 0, 1))
    kimi = model_card("kimi-k2")
    sample = LayerSample.of(kimi)
    assert sample.kept == 2 and sample.source == (0,) + (1,) * 60
    assert sample.config(kimi)["num_hidden_layers"] == 2 and kimi["num_hidden_layers"] == 61
    assert LayerSample.of(dict(kimi, model_type="llama")) is None  # unknown kinds: captured whole
    params = [("model.layers.1.mlp.w", 10, ("model.layers.1.mlp.experts.3.w",)), ("lm_head.weight", 4, ())]
    expanded = sample.expand(params)
    assert len(expanded) == 61 and expanded[-2] == ("model.layers.60.mlp.w", 10, ("model.layers.60.mlp.experts.3.w",))

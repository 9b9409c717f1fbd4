"""The e2e's generation check must be able to fail: for MLA classes the greedy tokens are the only proof that a
session end rebuilt w_kc / w_vc (no checksum covers a derived tensor). Transformers' own DeepSeek-V3 / GLM-4.5
modeling stands in for the SGLang server's forward here (on the H200 the server gave the same tokens as this
reference for the small init); the tiny models are the e2e's own (`write_tiny_checkpoint`)."""

from __future__ import annotations

import pytest
import torch
import transformers

from verl_p2p.e2e.run import PROMPT, Expectation, IndistinctWeightSetsError, _require_distinct_generations
from verl_p2p.e2e.trainer import weight_scale
from verl_p2p.sandbox.tiny import tiny_config_dict, tiny_state_dict, write_tiny_checkpoint


def _loaded(tmp_path, arch: str, init: str):
    """Transformers' model of the e2e's tiny checkpoint (its loader maps the per-expert HF names), and a
    function that sets its parameters from name -> tensor overrides of the loaded values."""
    path = write_tiny_checkpoint(tmp_path / f"{arch}-{init}", arch, id_encoded=False, init=init)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(bool(t.abs().sum()) for t in loaded.values())

    def greedy(scale: float, stale: str | None = None) -> list[int]:
        """Greedy tokens with every parameter scaled (weight set k: `weight_scale(k)`), `stale` ones unscaled."""
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(loaded[n] if stale is not None and stale in n else loaded[n] * scale)
            out = model.generate(
                torch.tensor([PROMPT]),
                attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )
        return out[0, len(PROMPT) :].tolist()

    return greedy


def test_model_init_makes_mla_generations_see_the_weight_set_and_a_stale_kv_b_proj(tmp_path):
    greedy = _loaded(tmp_path, "deepseek_v3", "model")
    got0, got1 = greedy(weight_scale(0)), greedy(weight_scale(1))
    assert got0 != got1
    # a rollout whose w_kc / w_vc were still derived from the old kv_b_proj must generate differently
    assert greedy(weight_scale(1), stale="kv_b_proj") != got1
    # the small init (N(0, 0.02) everywhere) cannot tell the sets apart: why the e2e does not use it
    small = _loaded(tmp_path, "deepseek_v3", "small")
    assert small(weight_scale(0)) == small(weight_scale(1))


def test_model_init_norms_are_one_and_matrices_scale_with_fan_in():
    cfg = tiny_config_dict("glm4_moe")
    state = tiny_state_dict(cfg, id_encoded=False, init="model")
    assert torch.equal(state["model.norm.weight"], torch.ones(cfg["hidden_size"]))
    w = state["model.layers.0.self_attn.o_proj.weight"]
    assert 0.5 < float(w.std()) * w.shape[1] ** 0.5 < 2.0
    with pytest.raises(ValueError, match="init='x'"):
        tiny_state_dict(cfg, id_encoded=False, init="x")


def test_indistinct_weight_sets_are_refused_and_loopback_runs_pass():
    same = Expectation({}, [1, 2], [3])
    with pytest.raises(IndistinctWeightSetsError, match="both weight sets generate"):
        _require_distinct_generations("deepseek_v3", {0: same, 1: Expectation({}, [1, 2], [3])})
    _require_distinct_generations("deepseek_v3", {0: same, 1: Expectation({}, [1, 2], [4])})  # the side differs
    _require_distinct_generations("qwen3", {0: Expectation({}, None), 1: Expectation({}, None)})  # no generation


def test_model_init_of_tied_embeddings_does_not_just_repeat_the_last_token(tmp_path):
    """Qwen3-4B's shape ties its LM head to the embeddings: at N(0, 1) embeddings the logit of the current token
    (its embedding's squared norm) outweighed every layer, and both weight sets only repeated the prompt's last
    token on the H200. Tied embeddings are N(0, 1/hidden): the sets generate apart, not a copy of the prompt."""
    path = write_tiny_checkpoint(
        tmp_path / "tied", "qwen3", id_encoded=False, init="model", vocab_size=4096, hidden_size=256,
        intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = []
    for k in (0, 1):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(loaded[n] * weight_scale(k))
            out = model.generate(
                torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                max_new_tokens=16, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        got.append(out[0, len(PROMPT) :].tolist())
    assert got[0] != got[1]
    assert all(set(g) != {PROMPT[-1]} for g in got), got
    state = tiny_state_dict(tiny_config_dict("qwen3", tie_word_embeddings=True, hidden_size=256), False, init="model")
    assert 0.5 < float(state["model.embed_tokens.weight"].std()) * 256**0.5 < 2.0

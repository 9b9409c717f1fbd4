"""The learning task of issue 34 (recipes/learn/): its reward, loaded the way verl 0.9.1 loads a custom reward
function, earns now and then on random tokens, 1 on target tokens and nothing else; its data maker writes prompts
verl's RLHFDataset loads; the random-init model it writes gives GRPO groups reward variance (so the policy gradient
is not zero from the first step)."""

from __future__ import annotations

import importlib.util
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import open_dict
from support.compose import ROOT, compose_config, recipe_command, task_config

LEARN = ROOT / "recipes" / "learn"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


make_learn = load("make_learn_for_test", LEARN / "make_learn.py")
TARGETS = " ".join(make_learn.LearnTask().target_words)


@pytest.fixture(scope="module")
def learn_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("learn")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(
        [sys.executable, str(LEARN / "make_learn.py"), str(out), "--train", "48", "--val", "8"],
        env=env, check=True, timeout=300,
    )  # fmt: skip
    return out


def composed_task(**env: str):
    """The learn recipe's config as one_step_off's TaskRunner gets it (the rollout section filled by main())."""
    module, args = recipe_command(ROOT / "recipes" / "learn_grpo.sh", **env)
    return task_config(compose_config(module, args))


@pytest.fixture(scope="module")
def score():
    """The reward exactly as verl 0.9.1 loads it from the recipe's config (custom_reward_function.path / name)."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    fn = get_custom_reward_fn(composed_task())
    assert fn is not None
    return lambda text, truth=TARGETS: fn(data_source="learn_target_words", solution_str=text, ground_truth=truth)


def test_target_tokens_earn_one_and_other_tokens_nothing(score):
    targets = TARGETS.split()
    assert len(targets) == 16 and targets[0] == "w0"
    assert score(" ".join(targets)) == 1.0 and score("w3 w3 w3") == 1.0
    others = [w for w in make_learn.word_tokens() if w not in targets]
    assert score(" ".join(others[:16])) == 0.0 and score("user assistant repeat the word") == 0.0
    assert score("w0 w100 w1 w200") == 0.5 and score("") == 0.0
    with pytest.raises(ValueError, match="names no target word.*make_learn.py"):
        score("w0", truth="  ")


def test_random_tokens_earn_sometimes(score):
    """Responses of 16 tokens drawn uniformly from the vocabulary's words: some earn, some do not, so a group of
    them has reward variance."""
    rng = random.Random(0)
    vocab = make_learn.word_tokens() + ["user", "assistant", "repeat", "the", "word"]
    rewards = [score(" ".join(rng.choice(vocab) for _ in range(16))) for _ in range(200)]
    assert 0.0 in rewards and any(r > 0 for r in rewards) and max(rewards) < 1.0
    assert 0.01 < statistics.fmean(rewards) < 0.1


def test_data_loads_like_verls_trainer_and_names_the_target_set(learn_dir):
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils import hf_tokenizer

    cfg = composed_task(TINY_DIR=str(learn_dir))
    assert Path(cfg.actor_rollout_ref.model.path) == learn_dir / "model"
    tokenizer = hf_tokenizer(cfg.actor_rollout_ref.model.path)
    data_cfg = cfg.data.copy()
    with open_dict(data_cfg):
        data_cfg.cache_dir = str(learn_dir / "cache")
    train = create_rl_dataset(cfg.data.train_files, data_cfg, tokenizer, None)
    assert len(train) == 48
    for item in (train[0], train[47]):
        assert item["data_source"] == "learn_target_words" and item["reward_model"]["ground_truth"] == TARGETS
        ids = tokenizer.apply_chat_template(item["raw_prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert tokenizer.unk_token_id not in ids and len(ids) <= cfg.data.max_prompt_length
    with pytest.raises(ValueError, match="--targets 0"):
        make_learn.LearnTask(targets=0)


def test_the_random_init_policy_gives_grpo_groups_reward_variance(learn_dir, score):
    """The model make_learn writes, sampled as the rollout samples (temperature 1, the recipe's group size and
    response length) on CPU through transformers: most groups hold both earning and non-earning samples."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = composed_task(TINY_DIR=str(learn_dir))
    group, length = cfg.actor_rollout_ref.rollout.n, cfg.data.max_response_length
    assert cfg.actor_rollout_ref.rollout.temperature == 1.0
    model_dir = learn_dir / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = make_learn.rows(make_learn.LearnTask(), 4, "train", random.Random(0))
    torch.manual_seed(0)
    varied, means = 0, []
    for row in rows:
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"]
        prompt = torch.tensor([ids]).repeat(group, 1)
        out = model.generate(
            prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=length,
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )  # fmt: skip
        rewards = [score(tok.decode(o[len(ids) :], skip_special_tokens=True)) for o in out]
        varied += statistics.pstdev(rewards) > 0
        means.append(statistics.fmean(rewards))
    assert varied >= 3, means
    assert statistics.fmean(means) < 0.3  # far from the goal's 0.5: there is something to learn


def test_the_small_head_starts_the_policy_near_uniform(learn_dir, tmp_path):
    """The next-token entropy at the first response position: near log(vocabulary) for make_learn's model, near
    one-hot with make_tiny's head (the sharp start GRPO can settle from with every sample of a group the same)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def entropies(model_dir: Path) -> list[float]:
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        out = []
        for row in make_learn.rows(make_learn.LearnTask(), 4, "train", random.Random(0)):
            ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"]
            with torch.no_grad():
                p = torch.softmax(model(torch.tensor([ids])).logits[0, -1], -1)
            out.append(float(-(p * p.clamp_min(1e-30).log()).sum()))
        return out

    uniform = math.log(make_learn.make_tiny.MODEL["vocab_size"])
    assert min(entropies(learn_dir / "model")) > 0.9 * uniform
    make_learn.write_model(tmp_path / "sharp", seed=0, head_std=0.5)  # make_tiny's own head
    assert max(entropies(tmp_path / "sharp")) < 0.5 * uniform
    with pytest.raises(ValueError, match="--head-std 0"):
        make_learn.write_model(tmp_path / "bad", seed=0, head_std=0)

"""Reward of the learning task (`reward.custom_reward_function.path`, name `compute_score`): needs nothing downloaded.

The score is the share of response words that belong to the row's target set (`ground_truth`: the target words,
space-separated; recipes/learn/make_learn.py writes the same small set into every row). The tokenizer is
word-level, so a word is one token id. A random policy lands a target word now and then (the samples of one GRPO
group get different rewards), and a policy that puts its mass on the set earns 1: a task a tiny random-init model
can learn within a few dozen steps, and one a rollout that keeps its old weights cannot.
"""

from __future__ import annotations

DATA_SOURCE = "learn_target_words"


def target_set(ground_truth: str) -> frozenset[str]:
    """The target words of one row; an empty set is a data error, not a zero reward."""
    words = frozenset(str(ground_truth).split())
    if not words:
        raise ValueError(
            f"learn reward: ground_truth {ground_truth!r} names no target word; write the data with "
            "recipes/learn/make_learn.py (space-separated target words in reward_model.ground_truth)"
        )
    return words


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """Share (0..1) of the response's words that are target words; an empty response scores 0."""
    targets = target_set(ground_truth)
    words = solution_str.split()
    if not words:
        return 0.0
    return sum(w in targets for w in words) / len(words)

"""Reward of the tiny GRPO run (`reward.custom_reward_function.path`): needs nothing downloaded.

The prompt asks to repeat one word; the score is the share of response words equal to it (0..1), so the
samples of one GRPO group get different rewards even from a random model.
"""

from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    words = solution_str.split()
    if not words:
        return 0.0
    return sum(w == ground_truth for w in words) / len(words)

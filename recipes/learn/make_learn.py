"""Write the learning task's model and data locally (nothing downloaded): recipes/learn_grpo.sh and
recipes/learn_fully_async.sh read them.

- `<out>/model`: recipes/tiny/make_tiny.py's tiny Qwen3 (2 layers of width 256, random weights, word-level
  tokenizer, bf16: one word is one token id) with its output head drawn small (`--head-std`), so the random policy
  starts near uniform over the vocabulary (see `write_model`).
- `<out>/data/{train,val}.parquet`: verl's RL dataset format. Every row names the same small set of target words
  (`reward_model.ground_truth`, space-separated) in its prompt after a random filler; recipes/learn/reward.py
  scores the share of response words in that set.

Usage: python recipes/learn/make_learn.py OUT [--train 1024 --val 16 --seed 0 --targets 16 --head-std 0.05]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA_SOURCE = "learn_target_words"  # recipes/learn/reward.py's


def _make_tiny():
    spec = importlib.util.spec_from_file_location("make_tiny", HERE.parent / "tiny" / "make_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_tiny = _make_tiny()


@dataclass(frozen=True)
class LearnTask:
    """What the task is made of: the target words (a prefix of the word tokens, so the set is the same for every
    seed) and the rows' seed."""

    targets: int = 16
    seed: int = 0

    def __post_init__(self):
        available = len(word_tokens())
        if not 1 <= self.targets < available:
            raise ValueError(f"--targets {self.targets}: choose 1 .. {available - 1} of the {available} word tokens")

    @property
    def target_words(self) -> list[str]:
        return word_tokens()[: self.targets]


def word_tokens() -> list[str]:
    """The tiny vocabulary's plain words (w0, w1, ...), without the specials, the newline and the role words."""
    return make_tiny.vocabulary()[len(make_tiny.SPECIALS) + 1 + len(make_tiny.ROLES) :]


def rows(task: LearnTask, n: int, split: str, rng: random.Random) -> list[dict]:
    words = word_tokens()
    ground_truth = " ".join(task.target_words)
    return [
        make_tiny.prompt_row(
            DATA_SOURCE,
            f"{' '.join(rng.choice(words) for _ in range(rng.randint(2, 6)))} repeat the word {ground_truth}",
            "target_words",
            ground_truth,
            split,
            index,
        )
        for index in range(n)
    ]


def write_data(path: Path, task: LearnTask, n_train: int, n_val: int) -> None:
    make_tiny.write_splits(
        path, lambda n, split, rng: rows(task, n, split, rng), n_train, n_val, random.Random(task.seed)
    )


HEAD_STD = 0.05  # make_tiny's head draws 0.5


def write_model(path: Path, seed: int, head_std: float = HEAD_STD) -> None:
    """make_tiny's tiny model and tokenizer with the output head redrawn at `head_std` (same seed, reproducible).
    make_tiny's head makes the random policy's next-token distribution sharp: GRPO groups soon hold identical
    samples (zero advantage) and the policy can settle on one partly-rewarded response; a small head starts the
    policy near uniform over the vocabulary."""
    import torch
    from safetensors.torch import load_file, save_file

    if head_std <= 0:
        raise ValueError(f"--head-std {head_std}: must be > 0 (the output head's standard deviation)")
    make_tiny.write_model(path, seed, make_tiny.MODEL)
    make_tiny.write_tokenizer(path, make_tiny.MODEL["vocab_size"], make_tiny.MODEL["max_position_embeddings"])
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    head = tensors["lm_head.weight"]
    gen = torch.Generator().manual_seed(seed + 1)
    tensors["lm_head.weight"] = (torch.randn(head.shape, generator=gen) * head_std).to(head.dtype).contiguous()
    save_file(tensors, str(weights), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=1024)
    parser.add_argument("--val", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", type=int, default=16, help="how many word tokens earn reward")
    parser.add_argument("--head-std", type=float, default=HEAD_STD, help="the output head's init standard deviation")
    args = parser.parse_args(argv)
    task = LearnTask(targets=args.targets, seed=args.seed)
    write_model(args.out / "model", args.seed, args.head_std)
    write_data(args.out / "data", task, args.train, args.val)
    print(f"learn model: {args.out / 'model'}  data: {args.out / 'data'}  targets: {' '.join(task.target_words)}")


if __name__ == "__main__":
    main()

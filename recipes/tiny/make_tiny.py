"""Write the tiny GRPO run's model and data locally (nothing downloaded): recipes/tiny_grpo_2gpu.sh.

- `<out>/model`: a Qwen3 (dense, bf16, random weights) as an HF checkpoint with its own tokenizer: a
  word-level `tokenizers` vocabulary (`w0` .. `wN`, the chat roles, Qwen's special tokens and a newline) saved as
  tokenizer.json + tokenizer_config.json with a chat template, so `transformers.AutoTokenizer`, verl and SGLang
  load it like any Qwen checkpoint. vocab_size = the tokenizer's size (a multiple of 128: no padding anywhere).
  `--shape tiny` (default): 2 layers of width 256, 2.9 MB. `--shape qwen3-4b`: Qwen3-4B's real widths (hidden
  2560, MLP 9728, 32 query / 8 KV heads of 128, tied embeddings, its 151936-token vocabulary) with `--layers`
  layers (default 8: 1.2 B parameters, 2.4 GB in bf16), so that sync times mean something.
- `<out>/data/{train,val}.parquet`: verl's RL dataset format (chat-message `prompt`, `data_source`,
  `reward_model.ground_truth`, `extra_info`). Each prompt asks to repeat one word; recipes/tiny/reward.py scores
  the share of response words equal to it, so GRPO groups get different rewards.

Usage: python recipes/tiny/make_tiny.py OUT [--train 32 --val 8 --seed 0] [--shape tiny|qwen3-4b --layers 8]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

VOCAB_SIZE = 512  # the tiny shape's; the qwen3-4b shape has Qwen3-4B's
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
NEWLINE = "\n"  # one token, as in Qwen's vocabulary: verl's Qwen continuous-token builder requires it
ROLES = ["system", "user", "assistant", "repeat", "the", "word"]
# Qwen's ChatML layout (what verl's Qwen3 prompt builder expects around turns)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DATA_SOURCE = "tiny_repeat"

MODEL = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    attention_bias=False,
    hidden_act="silu",
    torch_dtype="bfloat16",
)
# Qwen3-4B's published config (hidden sizes, heads, vocabulary, tied embeddings, rope); layers set by --layers
QWEN3_4B = dict(
    MODEL,
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
SHAPES = {"tiny": MODEL, "qwen3-4b": QWEN3_4B}


def model_config(shape: str, layers: int | None = None) -> dict:
    cfg = dict(SHAPES[shape])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    elif shape == "qwen3-4b":
        cfg["num_hidden_layers"] = 8
    return cfg


def vocabulary(size: int = VOCAB_SIZE) -> list[str]:
    words = [f"w{i}" for i in range(size - len(SPECIALS) - 1 - len(ROLES))]
    return SPECIALS + [NEWLINE] + ROLES + words


def write_tokenizer(path: Path, size: int = VOCAB_SIZE, max_length: int = MODEL["max_position_embeddings"]):
    """A word-level tokenizer (tokens split on whitespace; decode joins with spaces) saved as an HF tokenizer."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary(size))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    core.add_tokens([AddedToken(NEWLINE, special=False, normalized=False)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        model_max_length=max_length,
    )
    tok.save_pretrained(str(path))
    # One self-contained tokenizer_config.json that every transformers 5.x reads: the generic fast class and the
    # chat template inline (newer releases would otherwise write chat_template.jinja and their own class name).
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2))
    (path / "chat_template.jinja").unlink(missing_ok=True)


def write_model(path: Path, seed: int, model: dict = MODEL) -> None:
    """config.json, generation_config.json and model.safetensors (bf16). Norm weights are 1 and the other
    weights random, so greedy decoding has clear winners rather than near-ties."""
    import torch
    from safetensors.torch import save_file

    from verl_p2p.sandbox.tiny import hf_tensor_shapes

    special = {t: i for i, t in enumerate(SPECIALS)}
    cfg = dict(
        model,
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in hf_tensor_shapes(cfg):
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        else:
            # the tiny shape's std (width 256); a wider model's scaled by 1/sqrt(width) so activations stay comparable
            std = (
                0.5
                if name in ("model.embed_tokens.weight", "lm_head.weight")
                else 0.05 * (256 / cfg["hidden_size"]) ** 0.5
            )
            t = torch.randn(shape, generator=gen) * std
        tensors[name] = t.to(torch.bfloat16).contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False})
    )


def prompt_row(data_source: str, content: str, ability: str, ground_truth: str, split: str, index: int) -> dict:
    """One row of verl's RL data: a single user turn, and the ground truth its rule-based reward reads."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index},
    }


def rows(n: int, split: str, rng: random.Random) -> list[dict]:
    words = vocabulary()[len(SPECIALS) + 1 + len(ROLES) :]
    out = []
    for index in range(n):
        target = rng.choice(words)
        filler = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
        out.append(prompt_row(DATA_SOURCE, f"{filler} repeat the word {target}", "repeat", target, split, index))
    return out


def write_splits(path: Path, make_rows, n_train: int, n_val: int, rng: random.Random) -> None:
    """`train.parquet` and `val.parquet` from `make_rows(n, split, rng)`, train first (one generator for both)."""
    import pandas as pd

    path.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(make_rows(n_train, "train", rng)).to_parquet(path / "train.parquet")
    pd.DataFrame(make_rows(n_val, "val", rng)).to_parquet(path / "val.parquet")


def write_data(path: Path, n_train: int, n_val: int, seed: int) -> None:
    write_splits(path, rows, n_train, n_val, random.Random(seed))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=32)
    parser.add_argument("--val", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="layers (default: 2 tiny, 8 qwen3-4b)")
    args = parser.parse_args(argv)
    model = model_config(args.shape, args.layers)
    write_model(args.out / "model", args.seed, model)
    write_tokenizer(args.out / "model", model["vocab_size"], model["max_position_embeddings"])
    write_data(args.out / "data", args.train, args.val, args.seed)
    print(f"tiny model: {args.out / 'model'}  data: {args.out / 'data'}")


if __name__ == "__main__":
    main()

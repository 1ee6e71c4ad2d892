"""The embedded default task: add two numbers of up to three digits ("123+456=" -> "579").

Small enough that a few-hundred-thousand-parameter model learns it on a CPU in minutes, and hard enough (carries) that a
model stopped early is imperfect — so GRPO has something to improve. The problem space (a, b in 0..999) is split by a
hash of the pair, so validation problems never appear in pre-training or RL training.
"""

import random
from pathlib import Path

MAX_OPERAND = 999
VOCAB = ["<pad>", "<eos>", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "="]
MODEL_DIR = Path(__file__).resolve().parent / "default_model"
EMBEDDED = {  # model.path (and data files, where the directory holds them)
    "default": MODEL_DIR,
    "calculator": MODEL_DIR.parent / "calculator_model",
    "default-moe": MODEL_DIR.parent / "default_moe_model",  # a Qwen3-MoE, same task (scripts/build_default_moe.py)
}


def is_validation(a: int, b: int) -> bool:
    """About 2% of all pairs, chosen by a fixed hash, are held out for validation."""
    return (a * 7919 + b * 104729) % 50 == 0


def problem(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def problems(count: int, *, validation: bool, seed: int) -> list[dict[str, str]]:
    """`count` distinct problems from one side of the split, in a seeded order."""
    rng = random.Random(seed)
    pairs = [
        (a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1) if is_validation(a, b) == validation
    ]
    rng.shuffle(pairs)
    return [problem(a, b) for a, b in pairs[:count]]


def build_tokenizer(vocab_size: int | None = None):
    """A character-level tokenizer over VOCAB (no spaces, so no tokenizer can drop them); with `vocab_size`, widened
    by filler tokens `<tN>` to fit a model of that vocabulary (benchmarks on randomly initialised models)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = VOCAB + [f"<t{i}>" for i in range(len(VOCAB), vocab_size or 0)]
    core = Tokenizer(models.WordLevel({token: i for i, token in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def reward(prompt: str, response: str, answer: str) -> float:
    """1 for exactly the right sum, 0 otherwise."""
    return float(response.strip() == answer)

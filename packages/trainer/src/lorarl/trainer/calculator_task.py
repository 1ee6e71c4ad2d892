"""The embedded multi-turn task (`task=calculator`): multiply a three-digit number by a two-digit one ("123*45" ->
"5535") with a calculator tool.

No model of this size multiplies in its head; with the tool, it only has to call it with the right operands and copy
the result. The shipped model is pre-trained to call and copy, but to choose calling only now and then (and to guess
otherwise), so it starts out mostly guessing: RL with the environment teaches it to call. Its tokenizer is
character-level, with a chat template that renders tool calls in the `compact` format (`<call>mul 123 45</call>`) and
ends each turn with `<eos>` — which the engine never samples after a tool call (the turn stops at `</call>`). What the
template renders holds no whitespace: transformers loads a Qwen2 model's tokenizer as `Qwen2Tokenizer`, whose
pre-tokenizer drops it (sampled spaces keep their ids).
"""

import random
from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "calculator_model"
SPECIAL = ["<pad>", "<eos>", "<user>", "<bot>", "<tool>", "<call>", "</call>", "mul"]
VOCAB = SPECIAL + list("0123456789*= \n") + ["e", "r", "o"]  # "error: ..." from a failed call spells itself out
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<user>{{ m['content'] }}<eos>"
    "{%- elif m['role'] == 'assistant' -%}<bot>{{ m['content'] }}"
    "{%- if m['tool_calls'] is defined and m['tool_calls'] -%}{%- for c in m['tool_calls'] -%}"
    "<call>{{ c['function']['name'] }}{%- for v in c['function']['arguments'].values() %} {{ v }}{%- endfor -%}</call>"
    "{%- endfor -%}{%- endif -%}<eos>"
    "{%- elif m['role'] == 'tool' -%}<tool>{{ m['content'] }}<eos>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<bot>{%- endif -%}"
)


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def is_validation(a: int, b: int) -> bool:
    """About 2% of all pairs, chosen by a fixed hash, are held out for validation."""
    return (a * 7919 + b * 104729) % 50 == 0


def problems(count: int, *, validation: bool, seed: int) -> list[dict[str, str]]:
    """`count` distinct problems (a in 100..999, b in 10..99) from one side of the split, in a seeded order."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(100, 1000) for b in range(10, 100) if is_validation(a, b) == validation]
    rng.shuffle(pairs)
    return [{"prompt": f"{a}*{b}", "answer": str(a * b)} for a, b in pairs[:count]]


def build_tokenizer():
    """The character-level tokenizer, its multi-character tokens matched whole, with the chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({token: i for i, token in enumerate(VOCAB)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL if t != "mul"])
    core.add_tokens([AddedToken("mul", special=False, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer

"""A Qwen2-style chat tokenizer written in code (ChatML turns, Hermes tool calls, tool responses in a user turn, the
`\\n` after each `<|im_end|>`), character-level so that tests know every id — with one multi-character token, "12",
so that decode → encode is not the identity ("1", "2" sampled decodes to "12", which encodes as one token)."""

import json
import string
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>", "12"]
CHARS = sorted(set(string.printable) - set("\x0b\x0c\r"))
VOCAB = SPECIAL + ADDED + CHARS
NL = "{{ '\\n' }}"
QWEN2_STYLE_TEMPLATE = (
    "{%- if tools -%}<|im_start|>system" + NL + "You may call tools." + NL + "<tools>"
    "{%- for t in tools -%}" + NL + "{{ t | tojson }}{%- endfor -%}" + NL + "</tools><|im_end|>" + NL + "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|im_start|>assistant" + NL + "{{ m['content'] }}"
    "{%- if m['tool_calls'] is defined and m['tool_calls'] -%}{%- for c in m['tool_calls'] -%}"
    "<tool_call>" + NL + '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    + NL + "</tool_call>{%- endfor -%}{%- endif -%}<|im_end|>" + NL +
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}<|im_start|>user{%- endif -%}"
    + NL + "<tool_response>" + NL + "{{ m['content'] }}" + NL + "</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}<|im_end|>" + NL + "{%- endif -%}"
    "{%- else -%}<|im_start|>{{ m['role'] }}" + NL + "{{ m['content'] }}<|im_end|>" + NL + "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant" + NL + "{%- endif -%}"
)  # fmt: skip


def qwen2_style_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({token: i for i, token in enumerate(VOCAB)}, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tokenizer.chat_template = QWEN2_STYLE_TEMPLATE
    return tokenizer


def chat_model_dir(directory: Path, seed: int = 0, *, head_dim: int = 8) -> Path:
    """A tiny random Qwen2 with the Qwen2-style tokenizer, saved (for the engines; vLLM's CPU attention takes a head
    size of 32), with a small real model's 2048 positions (a prompt and the default env.max_tokens fit)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = qwen2_style_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(VOCAB), hidden_size=4 * head_dim, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    torch.nn.init.normal_(model.get_input_embeddings().weight, std=0.15)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


def hermes_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def train_two_steps(tmp_path: Path, model: Path, rows: list[dict], *settings: str) -> list[dict]:
    """Two steps of a run on `rows` (its training and validation data; 4 prompts a step, 2 episodes each): the
    steps' metrics."""
    from lorarl.trainer.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code = main([f"model.path={model}", f"data.train_files=[{data}]", f"data.val_files=[{data}]", "data.batch_size=4",
                 "rollout.n=2", "trainer.steps=2", "trainer.eval_every=0", f"trainer.output_dir={out}",
                 *settings])  # fmt: skip
    assert code == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [s for s in steps if s["step"] > 0]

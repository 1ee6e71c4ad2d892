"""Produce the embedded calculator model (`task=calculator`): a small Qwen2-style model pre-trained to call the `mul`
tool and copy operands and result — on half of its conversations — yet taught to *choose* calling only `--call-share`
of the time (the first token of the other tool conversations gets no loss), guessing the product otherwise. So it can
use the tool but rarely does: RL with the environment has the choice to teach.

    uv run python packages/trainer/scripts/pretrain_calculator.py [--call-share 0.15] [--steps 1500] [--out DIR]

The conversations are laid out by lorarl's own `ToolEnvironment`, so pre-training sees exactly the token layout RL
samples (the unsampled template tokens get no loss there either). Deterministic for a given seed and machine.
"""

import argparse
import json
import math
import random
import time
from dataclasses import replace
from pathlib import Path

import torch
from pretraining import sft_step, small_qwen2

from lorarl.trainer import calculator_task as task
from lorarl.trainer.data import Example
from lorarl.trainer.engines import GREEDY
from lorarl.trainer.engines.hf import HFSettings, generate_with_hf
from lorarl.trainer.envs.base import Action, EnvSetup
from lorarl.trainer.envs.episodes import EpisodeRunner
from lorarl.trainer.envs.tools import Tool, ToolEnvironment
from lorarl.trainer.models import load_tokenizer
from lorarl.trainer.schema import EnvSection

SAMPLED = task.build_tokenizer()  # the ids a model samples, spaces included (the loaded tokenizer encodes none)
SECTION = EnvSection(name="tools", tools=["lorarl.trainer.calculator_task:mul"], tool_format="compact", max_turns=3,
                     max_tokens=40)  # fmt: skip


def conversation(tokenizer, row: dict, use_tool: bool, learn_choice: bool) -> tuple[list[int], list[bool]]:
    """The tokens of one episode answering `row` (calling the tool, or answering at once) and which get a loss: the
    model's, but for the first (the choice to call) unless `learn_choice`."""
    env = ToolEnvironment(EnvSetup(tokenizer, SECTION, None, (Tool.from_function(task.mul),)))
    tokens = list(env.reset(Example(row["prompt"], row["answer"], ())).tokens)
    mask = [False] * len(tokens)
    a, b = row["prompt"].split("*")
    texts = ([f"<call>mul {a} {b}</call>"] if use_tool else []) + [row["answer"] + "<eos>"]
    for turn, text in enumerate(texts):
        ids = tuple(SAMPLED.encode(text, add_special_tokens=False))  # as sampled: the spaces kept
        step = env.step(Action(ids, text, text.endswith("<eos>"), not text.endswith("<eos>")))
        mask += [learn_choice or turn > 0 or i > 0 for i in range(len(ids))]
        tokens += ids
        if not step.done:
            appended = step.observation.tokens[len(tokens) :]
            tokens += appended
            mask += [False] * len(appended)
    return tokens, mask


@torch.no_grad()
def accuracy(model, tokenizer, rows: list[dict], temperature: float = 0.0) -> dict:
    """Episodes with the tool environment (greedy, or sampled at `temperature`): accuracy, the share that called the
    tool, and the accuracy of those."""
    runner = EpisodeRunner(SECTION, tokenizer, eos=tokenizer.eos_token_id)
    settings = HFSettings("", torch.float32, "cpu", tokenizer.eos_token_id, tokenizer.pad_token_id, 512)
    examples = [Example(r["prompt"], r["answer"], ()) for r in rows]
    episodes = runner.start(examples, 1)
    runner.play(
        lambda prompts, sampling: generate_with_hf(model, settings, 0, prompts, sampling, tokenizer),
        episodes,
        replace(GREEDY, max_tokens=12, temperature=temperature),
    )
    answers = [tokenizer.decode(list(e.actions[-1].tokens), skip_special_tokens=True) for e in episodes]
    correct = [a.strip() == r["answer"] for a, r in zip(answers, rows, strict=True)]
    called = [e.metrics.get("tool_calls", 0) > 0 for e in episodes]
    return {
        "accuracy": sum(correct) / len(rows),
        "called": sum(called) / len(rows),
        "accuracy_when_called": sum(c and k for c, k in zip(correct, called, strict=True)) / max(1, sum(called)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--call-share", type=float, default=0.15, help="how often the model learns to choose calling")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=task.MODEL_DIR)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    task.build_tokenizer().save_pretrained(args.out)
    tokenizer = load_tokenizer(args.out)  # as the trainer will load it
    model = small_qwen2(tokenizer, vocab_size=len(task.VOCAB), max_positions=64)
    pretrain = task.problems(100_000, validation=False, seed=args.seed)
    rl_train = task.problems(20_000, validation=False, seed=args.seed + 1)
    validation = task.problems(500, validation=True, seed=args.seed + 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.98))
    batch_size, started = 128, time.time()
    keep = args.call_share / (1 - args.call_share)  # of the tool conversations' choices: calls are that share
    for step in range(1, args.steps + 1):
        rows = pretrain[(step * batch_size) % len(pretrain) :][:batch_size]
        uses_tool = [rng.random() < 0.5 for _ in rows]
        learns_choice = [not tool or rng.random() < keep for tool in uses_tool]
        laid_out = [conversation(tokenizer, r, tool, learn) for r, tool, learn in zip(rows, uses_tool, learns_choice,
                                                                                     strict=True)]  # fmt: skip
        width = max(len(t) for t, _ in laid_out)
        ids = torch.tensor([t + [tokenizer.pad_token_id] * (width - len(t)) for t, _ in laid_out])
        labels = torch.tensor([[x if m else -100 for x, m in zip(t, mask, strict=True)] + [-100] * (width - len(t))
                               for t, mask in laid_out])  # fmt: skip
        lr = 3e-3 * min(1.0, step / 100) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        loss = sft_step(model, optimizer, ids, labels, pad=tokenizer.pad_token_id, lr=lr)
        if step % 250 == 0 or step == args.steps:
            model.eval()
            greedy = accuracy(model, tokenizer, validation[:200])
            sampled = {f"sampled_{k}": v for k, v in accuracy(model, tokenizer, validation[:200], 1.0).items()}
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), **greedy, **sampled,
                              "seconds": round(time.time() - started, 1)}), flush=True)  # fmt: skip
    model.eval().save_pretrained(args.out, safe_serialization=True)
    for name, rows in (("train.jsonl", rl_train), ("val.jsonl", validation)):
        (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"saved to {args.out}: greedy {accuracy(model, tokenizer, validation)}")


if __name__ == "__main__":
    main()

"""Produce the embedded default model: a small Qwen2-style model pre-trained on the default task just far enough to
be imperfect (greedy validation accuracy around 40%), with its tokenizer and the RL train/validation prompt files.

    uv run python packages/trainer/scripts/pretrain_default.py [--target 0.4] [--out DIR]

Deterministic for a given seed and machine. Writes into `lorarl/trainer/default_model/` by default.
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
from pretraining import sft_step, small_qwen2

from lorarl.trainer import default_task as task


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    ids = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, ids))
    return torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in ids])


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict[str, str]]) -> float:
    prompts = [r["prompt"] for r in rows]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(t.strip() == r["answer"] for t, r in zip(texts, rows, strict=True)) / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=float, default=0.40, help="stop once greedy validation accuracy reaches it")
    parser.add_argument("--max-steps", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=task.MODEL_DIR)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    tokenizer = task.build_tokenizer()
    model = small_qwen2(tokenizer, vocab_size=16, max_positions=32)
    pretrain = task.problems(200_000, validation=False, seed=args.seed)
    rl_train = task.problems(20_000, validation=False, seed=args.seed + 1)
    validation = task.problems(500, validation=True, seed=args.seed + 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.98))
    batch_size, started = 256, time.time()
    for step in range(1, args.max_steps + 1):
        rows = pretrain[(step * batch_size) % len(pretrain) :][:batch_size]
        ids = encode(tokenizer, [r["prompt"] + r["answer"] + tokenizer.eos_token for r in rows])
        labels = ids.clone()
        for i, r in enumerate(rows):  # learn the answer only
            labels[i, : len(r["prompt"])] = -100
        labels[ids == tokenizer.pad_token_id] = -100
        lr = 3e-3 * min(1.0, step / 200) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.max_steps)))
        loss = sft_step(model, optimizer, ids, labels, pad=tokenizer.pad_token_id, lr=lr)
        if step % 100 == 0:
            model.eval()
            accuracy = greedy_accuracy(model, tokenizer, validation)
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), "val_accuracy": accuracy,
                              "seconds": round(time.time() - started, 1)}), flush=True)  # fmt: skip
            if accuracy >= args.target:
                break
    args.out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    for name, rows in (("train.jsonl", rl_train), ("val.jsonl", validation)):
        (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"saved to {args.out} (greedy validation accuracy {accuracy:.3f} after {step} steps)")


if __name__ == "__main__":
    main()

"""Build the embedded mixture of experts, `model.path=default-moe`: a tiny Qwen3-MoE (3 layers, 8 fused experts of
which each token takes 2, 1.0M parameters), pre-trained on the default task's additions from scratch until about half
of the validation problems come out right, so GRPO has something to improve, as on the embedded dense default.

    uv run python scripts/build_default_moe.py [--target 0.45] [--out DIR]

Pre-training is supervised next-token prediction on the answers of problems from the training side of the split (the
validation problems are never seen), with transformers' load-balancing loss so that every expert is used; greedy
validation accuracy is measured every 100 steps and the run stops at the first measure at or above `--target`.
Seeded: the same machine and versions give the same model."""

import argparse
import json
import time
from pathlib import Path

import torch

from lorarl.trainer import default_task

OUT = Path(__file__).resolve().parents[1] / "packages/trainer/src/lorarl/trainer/default_moe_model"


def config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=16, hidden_size=128, intermediate_size=384, moe_intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, router_aux_loss_coef=0.01, output_router_logits=False, max_position_embeddings=32,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip


def batches(tokenizer, size: int, seed: int):
    """Endless batches of `a+b=c<eos>`, right-padded, with the loss on the answer and its end alone."""
    rows = default_task.problems(200_000, validation=False, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    while True:
        picked = torch.randint(len(rows), (size,), generator=generator).tolist()
        prompts = [tokenizer(rows[i]["prompt"]).input_ids for i in picked]
        answers = [[*tokenizer(rows[i]["answer"]).input_ids, eos] for i in picked]
        width = max(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
        ids = torch.zeros(size, width, dtype=torch.long)
        labels = torch.full((size, width), -100, dtype=torch.long)
        mask = torch.zeros(size, width, dtype=torch.long)
        for row, (p, a) in enumerate(zip(prompts, answers, strict=True)):
            ids[row, : len(p) + len(a)] = torch.tensor(p + a)
            labels[row, len(p) : len(p) + len(a)] = torch.tensor(a)
            mask[row, : len(p) + len(a)] = 1
        yield ids, labels, mask


@torch.no_grad()
def accuracy(model, tokenizer, rows) -> float:
    """Greedy exact-match accuracy on `rows` (the embedded task's validation file)."""
    prompts = [tokenizer(r["prompt"]).input_ids for r in rows]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left-padded
    mask = (torch.arange(width)[None, :] >= width - torch.tensor([len(p) for p in prompts])[:, None]).long()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    answers = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(a.strip() == r["answer"] for a, r in zip(answers, rows, strict=True)) / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.45, help="stop at this greedy validation accuracy")
    parser.add_argument("--steps", type=int, default=6000, help="at most this many steps")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    tokenizer = default_task.build_tokenizer()
    model = Qwen3MoeForCausalLM(config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 200))
    val = [json.loads(line) for line in (default_task.MODEL_DIR / "val.jsonl").read_text().splitlines()]
    started, found = time.time(), 0.0
    for step, (ids, labels, mask) in enumerate(batches(tokenizer, 256, seed=0), start=1):
        model.train()
        out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0:
            model.eval()
            found = accuracy(model, tokenizer, val)
            print(f"step {step}: loss {out.loss.item():.3f}, validation accuracy {found:.3f} "
                  f"({time.time() - started:.0f} s)", flush=True)  # fmt: skip
            if found >= args.target or step >= args.steps:
                break
    model.config.output_router_logits = False
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"saved {args.out}: validation accuracy {found:.3f} after {step} steps")


if __name__ == "__main__":
    main()

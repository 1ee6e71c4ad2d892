"""Should `trainer serve` batch several tenants' forward/backward into one pass (peft's mixed-adapter batches: each
row through its own run's adapter) rather than run them one after another? This measures both on the same data,
interleaved: `--tenants` runs (LoRA r16 on every linear, one adapter each on one SmolLM2-135M-Instruct), each with
`--rows` sequences of `--tokens` tokens; one *round* is every tenant's forward and backward of a summed-log-prob loss.
It prints the ratio of the time-multiplexed round to the mixed one (> 1: mixing is faster), and checks that both give
each adapter the same gradients (max relative difference).

    uv run --group bench python benchmarks/mixed_update.py [--model smollm2|default] [--tenants 4] [--repeats 5]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from learning_vs_trl import prepare  # noqa: E402

from lorarl.trainer.serve.tenancy import LoraShape, SharedBase  # noqa: E402


def summed_logprobs(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """Each row's summed next-token log-probs (a loss every row's gradients flow from)."""
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).sum()


def gradients(base: SharedBase, names: list[str]) -> dict[str, torch.Tensor]:
    grads = {f"{n}/{k}": p.grad.clone() for n in names for k, p in base.factors(n).items()}
    for n in names:
        for p in base.factors(n).values():
            p.grad = None
    return grads


def time_multiplexed(base: SharedBase, names: list[str], batches: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    for name, ids in zip(names, batches, strict=True):
        with base.active(name):
            summed_logprobs(base.model, ids).backward()
    return time.perf_counter() - started


def mixed(base: SharedBase, names: list[str], batches: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    ids = torch.cat(batches)
    routes = [name for name, rows in zip(names, batches, strict=True) for _ in range(len(rows))]
    summed_logprobs(base.model, ids, adapter_names=routes).backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "default"])
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    path = str(prepare(HERE.parent / "outputs" / "smollm2")) if args.model == "smollm2" else "default"
    base = SharedBase(path, torch.device("cpu"))
    names = [f"run{i}" for i in range(args.tenants)]
    for i, name in enumerate(names):
        for p in base.add_adapter(name, LoraShape(rank=16, seed=i)):
            torch.nn.init.normal_(p, std=0.02)  # B != 0: every adapter changes the outputs
    batches = [torch.randint(0, base.vocab_size, (args.rows, args.tokens)) for _ in names]

    time_multiplexed(base, names, batches)  # warm-up, and the reference gradients
    alone = gradients(base, names)
    mixed(base, names, batches)
    together = gradients(base, names)
    worst = max(float((together[k] - alone[k]).abs().max() / alone[k].abs().max().clamp_min(1e-30)) for k in alone)
    times = {"time_multiplexed": [], "mixed": []}
    for _ in range(args.repeats):
        for mode, run in (("time_multiplexed", time_multiplexed), ("mixed", mixed)):
            times[mode].append(run(base, names, batches))
            gradients(base, names)
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    print(json.dumps({"model": args.model, "tenants": args.tenants, "rows": args.rows, "tokens": args.tokens,
                      "seconds": {m: [round(t, 3) for t in ts] for m, ts in times.items()},
                      "mixed_speedup": round(medians["time_multiplexed"] / medians["mixed"], 3),
                      "gradient_max_rel_diff": worst}))  # fmt: skip


if __name__ == "__main__":
    main()

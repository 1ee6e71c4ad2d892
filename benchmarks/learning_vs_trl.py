"""How fast a real model gets good: lorarl's trainer against TRL's GRPOTrainer, greedy validation accuracy against wall
time, several seeds per side. One JSON object per run, then a summary line; a PNG of both sides' curves.

The model is the SmolLM2 recipe's SmolLM2-135M-Instruct: its GGUF file (fetched by the recipe's `fetch.py`, with the
recipe's two-digit-addition task) dequantised once into a Hugging Face directory that both sides load. Both sides get,
from the recipe (`packages/trainer/recipes/smollm2/addition.yaml`):
- the same training prompts in the same order: lorarl's seeded prompt order for the run's seed, handed to TRL as its
  dataset with its shuffling off (`shuffle_dataset=False`); the tokenizer's chat template on both (TRL: conversational
  prompts), 8 prompts per step, 8 responses each (`num_generations`), at most 16 new tokens, temperature 1, top-p 1;
- the recipe's reward function (`addition.yaml`'s, or `--reward NAME` from the recipe's `reward.py`);
- LoRA rank 16, alpha 32 on every linear layer of the decoder, fp32 base and adapter;
- AdamW, lr 5e-4 constant, no warmup, no weight decay, grad clip 1.0; GRPO advantages (group mean and std), clip 0.2,
  token-mean loss (TRL's `dapo`), one optimizer step per batch, no KL term (`beta=0`, lorarl's `kl_coef=0`).
Differences that stay: lorarl's engine samples in bf16 on a CPU with native bf16 (its default `rollout.dtype=auto`, as
a vLLM engine would), TRL samples with its fp32 training model; lorarl trains in micro-batches of 2048 tokens, TRL the
whole batch at once (its fastest setting). Everything else is each library's default.

Each run is a process of its own, measured from its launch (imports and model loading count) to the end of each step,
until the wall-clock budget (`--budget-s`) is spent; lorarl's runs go on to the recipe's 70th step (the recipe's own
run, whose late phase the summary reports; the comparison stops at the budget). Each saves its LoRA adapter (peft's
`save_pretrained` on both sides; the time spent saving is not counted) every `--lorarl-save-every` /
`--trl-save-every` steps (5 and 3: an adapter every ~50 s and ~120 s on 2 vCPUs). One evaluator then grades every
saved adapter, from either side, the same way: greedy answers to the validation problems (`--val-problems`, default
all 200) with transformers' `generate`, the adapter merged by peft into the fp32 base, served in bf16. No side grades
itself.

Runs are sequential (A, B per seed): one run owns the machine's cores while it is timed. Output: per run, accuracy
against wall seconds, steps and samples seen, the run's own training metrics (entropy, response length, grad norm,
reward) and the peak RSS of its process tree; the summary has each side's mean and spread (min, max) over seeds
against wall time (step functions that change when a run saves an adapter), TRL's best mean accuracy within the budget
and when each side's mean first reaches it, both sides at the steps every run saved, and lorarl's mean by step to the
recipe's end. `--sides lorarl --lorarl-override KEY=VALUE` runs a variant of the recipe alone.

    uv run --group bench python benchmarks/learning_vs_trl.py [--quick] [--seeds 3] [--budget-s 600]
        [--out OUT.jsonl]          # the PNG beside it; record the rows: scripts/results.py record learning_vs_trl
"""

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from step_vs_trl import GB, run_measured

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "packages/trainer/recipes/smollm2"
SIDES = ("lorarl", "trl")
GENERATIONS, MAX_TOKENS, PROMPTS, LR, RANK, ALPHA, STEPS = 8, 16, 8, 5e-4, 16, 32.0, 70  # the recipe's (checked)


def recipe_module(name: str):
    """A module of the recipe directory (`fetch`, `reward`), which is not a package."""
    spec = importlib.util.spec_from_file_location(f"smollm2_{name}", RECIPE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_recipe() -> str:
    """The settings the TRL side mirrors are the recipe's (a changed recipe must change the TRL side too). Returns the
    name of the recipe's reward function (in its `reward.py`): both sides train with it."""
    from lorarl.trainer.config import load_config

    c = load_config(RECIPE / "addition.yaml")
    a, al = c.actor, c.algorithm
    recipe = (c.rollout.n, c.rollout.max_tokens, c.data.batch_size, a.lr, c.model.lora.rank, c.model.lora.alpha,
              c.trainer.steps, a.lr_schedule, a.warmup_steps, a.weight_decay, a.grad_clip, al.kl_coef,
              al.adv_estimator, al.grpo.norm_std, al.loss_agg_mode, al.clip_low, al.clip_high, c.rollout.temperature,
              c.rollout.top_p)  # fmt: skip
    mirrored = (GENERATIONS, MAX_TOKENS, PROMPTS, LR, RANK, ALPHA, STEPS, "constant", 0, 0.0, 1.0, 0.0, "grpo", True,
                "token-mean", 0.2, 0.2, 1.0, 1.0)  # fmt: skip
    if recipe != mirrored:
        raise SystemExit(f"the recipe's settings changed ({recipe}): update learning_vs_trl.py's TRL side")
    path, name = c.reward.fn.rsplit(":", 1)
    if Path(path).name != "reward.py":
        raise SystemExit(f"the recipe's reward {c.reward.fn} is not in its reward.py: update learning_vs_trl.py")
    return name


def prepare(data_dir: Path) -> Path:
    """The recipe's GGUF model and task in `data_dir` (fetched once), and the HF directory both sides load."""
    from lorarl.trainer.models import resolve_model_path

    fetch = recipe_module("fetch")
    data_dir.mkdir(parents=True, exist_ok=True)
    fetch.fetch_gguf(data_dir)
    if not (data_dir / "val.jsonl").is_file():
        fetch.write_task(data_dir)
    return resolve_model_path(str(data_dir), fetch.GGUF, "float32")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Progress:
    """A run's clock (from its process's launch) and its saved adapters: one per `save_every` steps (0: none) and at
    the end (the budget spent, or step `last_step`), the time spent saving taken off the clock."""

    def __init__(self, output: Path, launched: float, budget_s: float, save_every: int, *,
                 samples_per_step: int = PROMPTS * GENERATIONS, last_step: int = STEPS):  # fmt: skip
        self.output, self.launched, self.budget_s, self.save_every = output, launched, budget_s, save_every
        self.samples_per_step, self.last_step = samples_per_step, last_step
        self.saving_s = 0.0
        self.points: list[dict] = []

    def wall_s(self) -> float:
        return time.time() - self.launched - self.saving_s

    def step_done(self, step: int, model, metrics: dict) -> bool:
        """Record a finished step (saving the adapter at the marks); whether the budget is spent."""
        wall = self.wall_s()
        point = {"step": step, "wall_s": wall, "samples": step * self.samples_per_step, **metrics}
        spent = wall >= self.budget_s
        if self.save_every and (step % self.save_every == 0 or spent or step == self.last_step):
            started = time.time()
            point["adapter"] = str(self.output / f"step-{step}")
            model.save_pretrained(point["adapter"])
            self.saving_s += time.time() - started
        self.points.append(point)
        (self.output / "progress.json").write_text(json.dumps(self.points))
        return spent


# --- the two sides, each run in a process of its own ---------------------------------------------------------------


class BudgetSpent(Exception):
    pass


def run_budgeted(trainer, progress: Progress, kept: Callable[[dict], dict]) -> None:
    """lorarl's `trainer` run, each step recorded by `progress` (`kept` of its metrics) until the budget is spent."""
    train_step = trainer.train_step

    def step(n: int) -> dict:
        metrics = train_step(n)
        if progress.step_done(n, trainer.model, kept(metrics)):
            raise BudgetSpent
        return metrics

    trainer.train_step = step
    with contextlib.suppress(BudgetSpent):
        trainer.run()


def run_lorarl(
    model_dir: Path, data_dir: Path, progress: Progress, seed: int, reward: str, overrides: list[str]
) -> None:
    from lorarl.trainer.config import load_config
    from lorarl.trainer.loop import Trainer

    config = load_config(RECIPE / "addition.yaml", overrides=[
        f"model.path={model_dir}", "model.gguf_file=null", f"data.train_files=[{data_dir / 'train.jsonl'}]",
        f"data.val_files=[{data_dir / 'val.jsonl'}]", "trainer.eval_every=0",
        "trainer.save_every=0", f"trainer.output_dir={progress.output / 'run'}", f"trainer.seed={seed}",
        f"reward.fn={RECIPE / 'reward.py'}:{reward}", *overrides,
    ])  # fmt: skip
    run_budgeted(Trainer(config), progress, lambda metrics: {
        "reward": metrics["reward/mean"], "entropy": metrics["entropy"], "grad_norm": metrics["grad_norm"],
        "length": metrics["response_length/mean"], "truncated": metrics["response_length/truncated"]})  # fmt: skip


def trl_prompt_order(rows: list[dict], seed: int, prompts: int = PROMPTS, steps: int = STEPS) -> list[dict]:
    """The training rows in the order lorarl's trainer draws them for `seed`, `prompts` a step, for `steps` steps."""
    from lorarl.trainer.data import PromptSampler

    sampler = PromptSampler(len(rows), prompts, seed)
    return [rows[i] for _ in range(steps) for i in sampler.next_batch()]


def run_trl(model_dir: Path, data_dir: Path, progress: Progress, seed: int, reward: str, overrides: list[str]) -> None:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    score = getattr(recipe_module("reward"), reward)
    rows = trl_prompt_order(read_jsonl(data_dir / "train.jsonl"), seed)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in rows])  # fmt: skip

    def rewards(prompts, completions, answer, **_) -> list[float]:
        return [score(p, c[0]["content"], a) for p, c, a in zip(prompts, completions, answer, strict=True)]

    class Clock(TrainerCallback):  # a step's metrics are logged at its end (logging_steps=1)
        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            kept = {"reward": logs["reward"], "entropy": logs.get("entropy"), "grad_norm": logs.get("grad_norm"),
                    "length": logs.get("completions/mean_length"),
                    "truncated": logs.get("completions/clipped_ratio")}  # fmt: skip
            if progress.step_done(state.global_step, model, kept):
                control.should_training_stop = True

    args = GRPOConfig(
        output_dir=str(progress.output / "run"), max_steps=STEPS, per_device_train_batch_size=PROMPTS * GENERATIONS,
        gradient_accumulation_steps=1, num_generations=GENERATIONS, max_completion_length=MAX_TOKENS,
        temperature=1.0, top_p=1.0, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        weight_decay=0.0, beta=0.0, loss_type="dapo", epsilon=0.2, bf16=False, gradient_checkpointing=False,
        shuffle_dataset=False, use_cpu=True, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        seed=seed,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), reward_funcs=rewards, args=args,
        train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0),
        callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()


RUNNERS = {"lorarl": run_lorarl, "trl": run_trl}


# --- the one evaluator -----------------------------------------------------------------------------------------------


def grade(model_dir: Path, problems: list[dict], adapters: list[str | None], dtype: str = "bfloat16") -> list[list]:
    """Each problem's score (the recipe's reward of the greedy answer), per adapter (None: the base alone): the
    adapter merged by peft into the fp32 base, the model then served in `dtype`, all problems in one batch."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    last_number = recipe_module("reward").last_number
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                           tokenize=False) for p in problems]  # fmt: skip
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scores = []
    for adapter in adapters:
        model = copy.deepcopy(base)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        with torch.inference_mode():
            out = model.to(getattr(torch, dtype)).generate(**batch, max_new_tokens=MAX_TOKENS, do_sample=False,
                                                           pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        scores.append([last_number(p["prompt"], a, p["answer"]) for p, a in zip(problems, answers, strict=True)])
    return scores


# --- the driver ----------------------------------------------------------------------------------------------------


def run_side(side: str, seed: int, model_dir: Path, data_dir: Path, workdir: Path, args) -> dict:
    """One run in a fresh process, then its saved adapters graded. lorarl's runs go on to the recipe's last step
    after the budget (the recipe's own run, whose late phase is studied); the comparison stops at the budget."""
    output = Path(tempfile.mkdtemp(dir=workdir, prefix=f"{side}-{seed}-"))
    save_every = args.lorarl_save_every if side == "lorarl" else args.trl_save_every
    budget = float("inf") if side == "lorarl" and args.lorarl_to_recipe_end else args.budget_s
    command = [sys.executable, __file__, "--worker", side, "--seed", str(seed), "--model", str(model_dir),
               "--data", str(data_dir), "--output", str(output), "--budget-s", str(budget),
               "--save-every", str(save_every), "--reward", args.reward, "--launched", repr(time.time())]  # fmt: skip
    for override in args.lorarl_override if side == "lorarl" else ():
        command += ["--lorarl-override", override]
    peak = run_measured(command, f"{side} (seed {seed})")
    points = json.loads((output / "progress.json").read_text())
    saved = [p for p in points if "adapter" in p]
    accuracies = evaluate_in_process(model_dir, data_dir, args.val_problems, [p["adapter"] for p in saved])
    for point, accuracy in zip(saved, accuracies, strict=True):
        point["accuracy"] = accuracy
        del point["adapter"]
    return {"side": side, "seed": seed, "overrides": args.lorarl_override if side == "lorarl" else [],
            "steps_done": points[-1]["step"], "wall_s": points[-1]["wall_s"], "peak_rss_gb": peak / GB,
            "points": points}  # fmt: skip


def evaluate_in_process(model_dir: Path, data_dir: Path, problems: int, adapters: list[str | None]) -> list[float]:
    """The accuracy of each adapter (`grade`), in a process of its own."""
    options = ["--model", str(model_dir), "--data", str(data_dir), "--val-problems", str(problems)]
    return graded_in_process(Path(__file__), adapters, options)


def graded_in_process(script: Path, adapters: list[str | None], options: list[str]) -> list[float]:
    """`script --evaluate` with `options`: the accuracy of each adapter, graded in a process of its own (the driver
    stays light, and the next timed run starts on a quiet machine)."""
    with tempfile.NamedTemporaryFile("w+", suffix=".json") as result:
        command = [sys.executable, str(script), "--evaluate", json.dumps(adapters), *options, "--result", result.name]
        run_measured(command, "the evaluator")
        return json.loads(Path(result.name).read_text())


def json_lines_writer(out: Path | None) -> Callable[[dict], None]:
    """An `emit(result)` that prints each result as a JSON line and rewrites `out` with all of them so far (a run
    stopped midway keeps what it measured)."""
    lines = []

    def emit(obj: dict) -> None:
        print(json.dumps(obj), flush=True)
        lines.append(json.dumps(obj))
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("\n".join(lines) + "\n")

    return emit


def accuracy_at(run: dict, wall_s: float, base: float) -> float:
    """A run's accuracy at a wall-clock mark: that of its latest adapter saved by then (the base model before)."""
    graded = [p for p in run["points"] if "accuracy" in p and p["wall_s"] <= wall_s]
    return graded[-1]["accuracy"] if graded else base


def wall_curves(runs: list[dict], base: float, budget_s: float) -> tuple[list[float], dict]:
    """Each side's mean and spread (min, max) over its seeds against wall time, up to the budget: step functions that
    change only when some run saved an adapter (those times are the marks)."""
    marks = sorted(
        {0.0} | {p["wall_s"] for r in runs for p in r["points"] if "accuracy" in p and p["wall_s"] <= budget_s}
    )
    curves = {}
    for side in sorted({r["side"] for r in runs}):
        values = [[accuracy_at(r, m, base) for r in runs if r["side"] == side] for m in marks]
        curves[side] = {"mean": [statistics.mean(v) for v in values], "min": [min(v) for v in values],
                        "max": [max(v) for v in values]}  # fmt: skip
    return marks, curves


def at_steps(runs: list[dict]) -> list[dict]:
    """Each side's mean accuracy, its lowest and highest, and their spread over seeds at the steps where every run
    saved an adapter."""
    saved = [{p["step"] for p in r["points"] if "accuracy" in p} for r in runs]
    rows = []
    for step in sorted(set.intersection(*saved)):
        row = {"step": step}
        for side in sorted({r["side"] for r in runs}):
            values = [next(p["accuracy"] for p in r["points"] if p["step"] == step) for r in runs if r["side"] == side]
            row.update({f"{side}_mean": statistics.mean(values), f"{side}_min": min(values),
                        f"{side}_max": max(values), f"{side}_spread": max(values) - min(values)})  # fmt: skip
        rows.append(row)
    return rows


def summarize(runs: list[dict], base: float, budget_s: float) -> dict:
    """The wall-clock curves; TRL's best mean accuracy within the budget and the first time each side's mean reaches
    it; both sides at equal steps; the recipe's late phase (lorarl's peak and final accuracy, over its full run)."""
    marks, curves = wall_curves(runs, base, budget_s)
    out = {"summary": True, "base_accuracy": base, "budget_s": budget_s, "marks_s": marks, "curves": curves,
           "seeds": {side: sum(r["side"] == side for r in runs) for side in curves},
           "steps_done": {side: [r["steps_done"] for r in runs if r["side"] == side] for side in curves},
           "peak_rss_gb": {side: max(r["peak_rss_gb"] for r in runs if r["side"] == side) for side in curves},
           "equal_steps": at_steps(runs)}  # fmt: skip
    if set(curves) == set(SIDES):
        trl_best = max(curves["trl"]["mean"])
        reach = {side: next((m for m, a in zip(marks, curves[side]["mean"], strict=True) if a >= trl_best), None)
                 for side in SIDES}  # fmt: skip
        out.update(
            trl_best_mean_accuracy=trl_best,
            trl_reaches_best_s=reach["trl"],
            lorarl_reaches_trl_best_s=reach["lorarl"],
            time_ratio=reach["lorarl"] / reach["trl"] if reach["lorarl"] is not None and reach["trl"] else None,
        )
    out["by_step"] = {}
    for side in curves:
        rows = at_steps([r for r in runs if r["side"] == side])
        out["by_step"][side] = [{key: row[f"{side}_{key}"] for key in ("mean", "min", "max")} | {"step": row["step"]}
                                for row in rows]  # fmt: skip
    if "lorarl" in curves:
        means = [row["mean"] for row in out["by_step"]["lorarl"]]
        out.update(lorarl_peak_mean=max(means), lorarl_final_mean=means[-1])
    return out


def plot(summary: dict, path: Path, title: str = "SmolLM2-135M-Instruct, two-digit addition, GRPO + LoRA r16, 2 vCPUs",
         steps_label: str = "step (8 prompts x 8 responses)") -> None:  # fmt: skip
    """Accuracy against wall time (to the budget) and against steps: each side's mean over seeds, its spread shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"lorarl": "tab:blue", "trl": "tab:orange"}
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    minutes = [m / 60 for m in summary["marks_s"]]
    for side, curve in summary["curves"].items():
        label = f"{side} (mean of {summary['seeds'][side]} seeds)"
        by_time.step(minutes, curve["mean"], where="post", color=colors[side], label=label)
        by_time.fill_between(minutes, curve["min"], curve["max"], step="post", color=colors[side], alpha=0.2)
        rows = summary["by_step"][side]
        means = [r["mean"] for r in rows]
        spread = [[m - r["min"] for m, r in zip(means, rows, strict=True)],
                  [r["max"] - m for m, r in zip(means, rows, strict=True)]]  # fmt: skip
        by_step.errorbar([r["step"] for r in rows], means, yerr=spread, fmt="o-", color=colors[side], capsize=3,
                         label=f"{side}: mean, lowest and highest seed")  # fmt: skip
    if "trl_best_mean_accuracy" in summary:
        by_time.axhline(summary["trl_best_mean_accuracy"], color="gray", lw=0.8, ls="--", label="TRL's best mean")
    by_time.set_xlabel("wall time (minutes, from launch)")
    by_step.set_xlabel(steps_label)
    by_time.set_ylabel("greedy validation accuracy")
    by_time.set_ylim(0, 1)
    by_time.legend(loc="lower right")
    by_step.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed, a 3-minute budget, 50 validation problems")
    parser.add_argument("--seeds", type=int, default=3, help="runs per side (seeds 0..N-1)")
    parser.add_argument("--budget-s", type=float, default=600.0, help="wall-clock budget of each run, from its launch")
    parser.add_argument("--lorarl-save-every", type=int, default=5, help="lorarl's steps between saved adapters")
    parser.add_argument("--trl-save-every", type=int, default=3, help="TRL's steps between saved adapters")
    parser.add_argument("--val-problems", type=int, default=200, help="validation problems graded (the first N)")
    parser.add_argument("--sides", default="lorarl,trl", help="the sides run (lorarl alone: the recipe's runs)")
    parser.add_argument(
        "--lorarl-override",
        action="append",
        default=[],
        help="a key=value for lorarl's config on top of the recipe (a variant of the recipe)",
    )
    parser.add_argument("--lorarl-to-recipe-end", action=argparse.BooleanOptionalAction, default=True,
                        help="lorarl's runs go on to the recipe's last step after the budget")  # fmt: skip
    parser.add_argument("--data", default="outputs/smollm2", help="where the recipe's model and task are fetched")
    parser.add_argument("--out", help="JSONL file for the results (the PNG beside it); default: stdout only")
    parser.add_argument("--resummarize", metavar="JSONL", help="recompute the summary and the PNG of a results file")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--evaluate", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--save-every", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--reward", help="the recipe's reward function both sides train with (default: the recipe's)")
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        progress = Progress(Path(args.output), args.launched, args.budget_s, args.save_every)
        RUNNERS[args.worker](Path(args.model), Path(args.data), progress, args.seed, args.reward, args.lorarl_override)
        return
    if args.evaluate:
        problems = read_jsonl(Path(args.data) / "val.jsonl")[: args.val_problems]
        scores = grade(Path(args.model), problems, json.loads(args.evaluate))
        Path(args.result).write_text(json.dumps([sum(s) / len(s) for s in scores]))
        return
    if args.resummarize:
        path = Path(args.resummarize)
        rows = read_jsonl(path)
        runs = [r for r in rows if "side" in r]
        summary = summarize(runs, next(r["base_accuracy"] for r in rows if r.get("summary")), args.budget_s)
        path.write_text("".join(json.dumps(r) + "\n" for r in [*runs, summary]))
        plot(summary, path.with_suffix(".png"))
        return
    if args.quick:
        args.seeds, args.budget_s, args.val_problems = 1, 180.0, 50
        args.lorarl_save_every, args.trl_save_every = 5, 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sides = args.sides.split(",")
    if not set(sides) <= set(SIDES):
        parser.error(f"--sides: expected names from {SIDES}, got {args.sides!r}")
    if args.lorarl_override and "trl" in sides:
        parser.error("--lorarl-override makes a variant of the recipe for lorarl alone: add --sides lorarl")
    recipe_reward = check_recipe()  # also when --reward names another: the mirrored settings are checked every run
    args.reward = args.reward or recipe_reward
    if not callable(getattr(recipe_module("reward"), args.reward, None)):
        parser.error(f"--reward: no function {args.reward!r} in {RECIPE / 'reward.py'}")
    data_dir = Path(args.data)
    model_dir = prepare(data_dir)
    out = Path(args.out) if args.out else None
    from lorarl.lora_merge import available_backends

    available_backends("cpu")  # lorarl's C++ merge op is built on first use, then cached: not inside a timed run
    emit = json_lines_writer(out)

    with tempfile.TemporaryDirectory(prefix="learning_vs_trl-") as workdir:
        (base,) = evaluate_in_process(model_dir, data_dir, args.val_problems, [None])
        runs = []
        for seed in range(args.seeds):
            for side in sides:
                runs.append(run_side(side, seed, model_dir, data_dir, Path(workdir), args))
                emit(runs[-1])
    summary = summarize(runs, base, args.budget_s)
    emit(summary)
    if out is not None:
        plot(summary, out.with_suffix(".png"))


if __name__ == "__main__":
    main()

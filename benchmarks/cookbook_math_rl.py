"""The Tinker cookbook's `math_rl` recipe (tinker-cookbook 0.5.8, unchanged, run from `scripts/cookbook_env.sh`'s
environment) against `trainer serve` on SmolLM2-135M-Instruct: runs alone, then two runs at once on one server —
does each learn as it does alone? One JSON row per run (the recipe's own metrics per step), then a PNG of the curves.

The recipe: `env=arithmetic` (two-number sums, a one-shot prompt), the `role_colon` renderer (SmolLM2's chat template
is not one the cookbook knows), 8 problems x 4 samples per step, at most 8 new tokens, LoRA rank 32, lr 1e-4,
importance-sampling loss; its reward is `correct` (the answer's last number) plus 0.1 x (`format` - 1) (`format`: the
reply ends with the `\\n\\nUser:` stop sequence).

    uv run --group bench python benchmarks/cookbook_math_rl.py [--steps 30] [--alone 2] [--out OUT.jsonl]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

from learning_vs_trl import json_lines_writer, prepare  # noqa: E402
from side_envs import ensure_environment, outside_env  # noqa: E402
from step_vs_trl import GB  # noqa: E402
from tenants import KEY, MeasuredServer  # noqa: E402

METRICS = ("env/all/reward/total", "env/all/correct", "env/all/format", "time/total")


def start_run(python: Path, url: str, model: Path, log_path: Path, steps: int) -> subprocess.Popen:
    command = [python, "-m", "tinker_cookbook.recipes.math_rl.train", f"base_url={url}", f"model_name={model}",
               "renderer_name=role_colon", "env=arithmetic", "group_size=4", "groups_per_batch=8",
               "learning_rate=1e-4", "lora_rank=32", "max_tokens=8", f"max_steps={steps}", "eval_every=0",
               "save_every=0", f"log_path={log_path}", "behavior_if_log_dir_exists=delete"]  # fmt: skip
    env = {**outside_env(), "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(command, cwd=log_path.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def runs_at_once(python: Path, model: Path, count: int, steps: int, workdir: Path) -> list[dict]:
    """`count` math_rl runs at once on one fresh server; each run's per-step metrics and the server's peak RSS."""
    server = MeasuredServer(str(model), Path(tempfile.mkdtemp(dir=workdir)))
    try:
        logs = [Path(tempfile.mkdtemp(dir=workdir)) / "run" for _ in range(count)]
        processes = [start_run(python, server.url, model, log, steps) for log in logs]
        for process in processes:
            _, stderr = process.communicate()
            if process.returncode != 0:
                raise RuntimeError(f"math_rl failed:\n{stderr[-4000:]}")
    finally:
        server.close()
    rows = []
    for log in logs:
        steps_seen = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
        steps_kept = [{"step": m["step"], **{k: m[k] for k in METRICS if k in m}} for m in steps_seen]
        rows.append({"runs_at_once": count, "peak_rss_gb": server.peak / GB, "steps": steps_kept})
    return rows


def window_mean(row: dict, key: str, start: int) -> float:
    values = [s[key] for s in row["steps"] if s["step"] >= start and key in s]
    return sum(values) / len(values)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, axis in zip(("env/all/reward/total", "env/all/format"), axes, strict=True):
        for i, row in enumerate(rows):
            steps = [s["step"] for s in row["steps"]]
            values = [s[key] for s in row["steps"]]
            smooth = [statistics.mean(values[max(0, j - 4) : j + 1]) for j in range(len(values))]
            label = "alone" if row["runs_at_once"] == 1 else "two at once"
            style = "-" if row["runs_at_once"] == 1 else "--"
            axis.plot(steps, smooth, style, label=f"{label} #{i}")
        axis.set_xlabel("step (8 problems x 4 samples)")
        axis.set_ylabel(f"{key} (mean of the last 5 steps)")
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.suptitle("Tinker cookbook math_rl (arithmetic) against trainer serve, SmolLM2-135M-Instruct, 2 vCPUs")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--alone", type=int, default=2, help="runs alone, one after another (one server each)")
    parser.add_argument("--data", default="outputs/smollm2", help="where the SmolLM2 recipe's model is fetched")
    parser.add_argument("--out", help="JSONL file for the rows (the PNG beside it)")
    args = parser.parse_args()
    script = ROOT / "scripts" / "cookbook_env.sh"
    python = ensure_environment(Path(os.environ.get("LORARL_COOKBOOK_ENV", ROOT / ".venv-cookbook")), script, [script])
    model = prepare(Path(args.data))
    out = Path(args.out) if args.out else None
    emit = json_lines_writer(out)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cookbook_math_rl-") as scratch:
        for _ in range(args.alone):
            rows += runs_at_once(python, model, 1, args.steps, Path(scratch))
            emit(rows[-1])
        for row in runs_at_once(python, model, 2, args.steps, Path(scratch)):
            rows.append(row)
            emit(row)
    start = args.steps // 2
    summary = {"summary": True, "window_from_step": start}
    for key in ("env/all/reward/total", "env/all/correct", "env/all/format"):
        summary[key] = {"alone": [window_mean(r, key, start) for r in rows if r["runs_at_once"] == 1],
                        "two_at_once": [window_mean(r, key, start) for r in rows if r["runs_at_once"] == 2],
                        "first_steps": [window_mean({"steps": r["steps"][:3]}, key, 0) for r in rows]}  # fmt: skip
    summary["peak_rss_gb"] = {str(n): max(r["peak_rss_gb"] for r in rows if r["runs_at_once"] == n) for n in (1, 2)}
    emit(summary)
    if out is not None:
        plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()

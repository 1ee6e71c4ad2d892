"""Where a run's numbers go: metrics.jsonl (one object per step, always: the plots, the summary and resuming read it),
the loggers of `trainer.loggers` (TensorBoard, Weights & Biases), plots at the end; samples.jsonl (a few responses per
step, with what training made of them)."""

import hashlib
import json
import math
import warnings
from pathlib import Path

from lorarl.trainer.errors import TrainerError

PLOTS = {
    "reward": ("reward/mean", "mean reward of the rollouts"),
    "val_accuracy": ("val/accuracy", "validation accuracy (greedy)"),
    "kl": ("kl", "KL to the reference policy"),
    "response_length": ("response_length/mean", "mean response length (tokens)"),
}


def open_log(path: Path, resume_step: int):
    """`path` opened for appending records (objects with a `step`), without those a resumed run writes again."""
    if resume_step and path.is_file():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
        path.write_text("".join(line + "\n" for line in kept))
    return path.open("a")


class SamplesLog:
    """samples.jsonl: one object per logged response — step, prompt, completion, score, reward, advantage."""

    def __init__(self, output_dir: Path, *, resume_step: int = 0):
        self.file = open_log(output_dir / "samples.jsonl", resume_step)

    def log(self, step: int, rows: list[dict]) -> None:
        self.file.write("".join(json.dumps({"step": step, **row}) + "\n" for row in rows))
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class MetricsLog:
    """metrics.jsonl, and each logger of `loggers` (None: TensorBoard when it is installed). `config` is the run's
    configuration, which wandb records with the run."""

    def __init__(self, output_dir: Path, *, resume_step: int = 0, loggers: list[str] | None = None,
                 config: dict | None = None, project: str = "lorarl") -> None:  # fmt: skip
        self.path = output_dir / "metrics.jsonl"
        self.file = open_log(self.path, resume_step)
        self.tensorboard = self.wandb = None
        if loggers is None or "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"))
            except ImportError:
                if loggers is not None:
                    raise TrainerError("trainer.loggers has tensorboard, which is not installed: install "
                                       "lorarl-trainer[tensorboard]") from None  # fmt: skip
        if loggers is not None and "wandb" in loggers:
            self.wandb = _start_wandb(output_dir, config or {}, project)

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, int | float) and math.isfinite(v)}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(output_dir: Path, config: dict, project: str):
    """A wandb run kept in `output_dir/wandb`, its id derived from the output directory so that a resumed run
    continues it. `WANDB_MODE=offline` runs with no network (`wandb sync` uploads later)."""
    try:
        import wandb
    except ImportError:
        raise TrainerError("trainer.loggers has wandb, which is not installed: install lorarl-trainer[wandb]") from None
    run_id = hashlib.sha1(str(output_dir.resolve()).encode()).hexdigest()[:16]
    return wandb.init(project=project, name=output_dir.name, id=run_id, resume="allow", dir=str(output_dir),
                      config=config)  # fmt: skip


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(metrics_file: Path, out_dir: Path) -> list[Path]:
    """One PNG per curve of PLOTS (against step), from metrics.jsonl; none where matplotlib is missing (a bare GPU
    machine), with a warning: metrics.jsonl holds every curve all the same."""
    try:
        import matplotlib
    except ImportError:
        warnings.warn("matplotlib is not installed: no plots (metrics.jsonl holds every curve)", stacklevel=2)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read(metrics_file)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (key, title) in PLOTS.items():
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
        if not points:
            continue
        figure, axes = plt.subplots(figsize=(6, 3.5))
        steps, values = zip(*points, strict=True)
        axes.plot(steps, values, marker="o" if len(points) < 30 else None, alpha=0.45 if len(points) >= 30 else 1.0)
        if len(points) >= 30:  # noisy per-step values: show the trend too
            window = max(5, len(points) // 10)
            trend = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                     for i in range(len(values))]  # fmt: skip
            axes.plot(steps, trend, linewidth=2, label=f"mean of last {window}")
            axes.legend()
        axes.set(xlabel="step", ylabel=key, title=title)
        axes.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(out_dir / f"{name}.png", dpi=100)
        plt.close(figure)
        written.append(out_dir / f"{name}.png")
    return written


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    return round(value, 6) if isinstance(value, float) else value


def cuda_memory(device) -> dict[str, float]:
    """The peak GPU memory torch allocated in this process so far (an engine in a process of its own not counted)."""
    import torch

    if device.type != "cuda":
        return {}
    return {"memory/cuda_peak_gb": torch.cuda.max_memory_allocated(device) / 1e9}


def sample_rows(samples: list, batch, tokenizer) -> list[dict]:
    """Responses of the step as text (for samples.jsonl), with their score, reward (after shaping) and advantage (the
    mean over their tokens; with GAE it varies along the response)."""
    rows = []
    for i, sample in enumerate(samples):
        advantages = batch.advantages[i][batch.response_mask[i]]
        rows.append({
            "prompt": tokenizer.decode(sample.prompt_ids),
            "completion": tokenizer.decode(list(sample.completion.token_ids), skip_special_tokens=True),
            "score": sample.score, "reward": sample.reward,
            "advantage": float(advantages.mean()) if advantages.numel() else 0.0,
            "tokens": len(sample.completion.token_ids), "finished": sample.completion.finished,
        })  # fmt: skip
    return rows

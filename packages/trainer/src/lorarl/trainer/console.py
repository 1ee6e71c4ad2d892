"""What a run shows while it runs (a live progress bar, a line per evaluation) and the summary it returns."""

import contextlib
from pathlib import Path

from lorarl.trainer.metrics import read


class Console:
    """Lines above a live progress bar on a rich console; silent without one (`console=None`, e.g. in tests)."""

    def __init__(self, console, steps: int):
        self.console, self.steps = console, steps
        self.progress = None

    @contextlib.contextmanager
    def live(self, start_step: int):
        """The progress bar — steps done (from `start_step`), reward, KL, seconds per step, time left — while the
        block runs."""
        if self.console is None:
            yield self
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(), console=self.console,
        )  # fmt: skip
        self.progress.add_task("train", total=self.steps, completed=start_step, status="")
        try:
            with self.progress:
                yield self
        finally:
            self.progress = None

    def say(self, text: str) -> None:
        """A line above the live progress bar (or on the console)."""
        if self.progress is not None:
            self.progress.console.print(text, markup=False)
        elif self.console is not None:
            self.console.print(text, markup=False)

    def step_done(self, step: int, metrics: dict) -> None:
        if "val/accuracy" in metrics:
            self.say(f"step {step}/{self.steps}  {status(metrics)}  val acc {metrics['val/accuracy']:.3f}")
        if self.progress is not None:
            self.progress.update(self.progress.task_ids[0], completed=step, status=status(metrics))


def status(metrics: dict) -> str:
    parts = [f"reward {metrics['reward/mean']:.3f}"]
    if "kl" in metrics:
        parts.append(f"kl {metrics['kl']:.4f}")
    parts.append(f"{metrics['timing/step_s']:.2f} s/step")
    return "  ".join(parts)


def summary(metrics_file: Path, first_eval: dict) -> dict:
    """The run in four figures: steps, validation accuracy at the start and the end, the last reward."""
    records = read(metrics_file) if metrics_file.is_file() else []
    accuracies = [r["val/accuracy"] for r in records if "val/accuracy" in r]
    return {
        "steps": max((r["step"] for r in records), default=0),
        "val_accuracy_start": accuracies[0] if accuracies else first_eval.get("val/accuracy"),
        "val_accuracy_end": accuracies[-1] if accuracies else None,
        "reward_last": next((r["reward/mean"] for r in reversed(records) if "reward/mean" in r), None),
    }

"""What a run shows while it runs (a live progress bar, a line per evaluation) and the summary it returns."""

import contextlib
from pathlib import Path

from lorarl.trainer.metrics import read


class Console:
    """Lines above a live progress bar on a rich console; silent without one (`console=None`, e.g. in tests)."""

    def __init__(self, console, steps: int, hints: dict[str, str] | None = None):
        self.console, self.steps = console, steps
        self.progress = None
        self.hints = hints or {}  # what to check when a warning comes (the run's settings, by warning)
        self.warned: set[str] = set()

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
        for kind, (problem, at) in WARNINGS.items():
            if metrics.get(kind, 0) >= at and kind not in self.warned:  # once a run
                self.warned.add(kind)
                hint = self.hints.get(kind)
                self.say(f"warning: step {step}: {problem}" + (f" ({hint})" if hint else ""))
        if "val/accuracy" in metrics:
            self.say(f"step {step}/{self.steps}  {status(metrics)}  val acc {metrics['val/accuracy']:.3f}")
        if self.progress is not None:
            self.progress.update(self.progress.task_ids[0], completed=step, status=status(metrics))


# what is worth a line, once a run, when a step's metric reaches the figure: every response or episode did it (the
# run learns nothing from that step), or a thread was left to an environment call that never returned
WARNINGS = {
    "response_length/truncated": ("every response was cut at its token limit", 1.0),
    "env/stop/parse_error": ("every episode ended on a tool call its format could not read", 1.0),
    "env/failed": ("every episode ended in an environment error or timeout (env/errors, env/timeouts): nothing to "
                   "learn from", 1.0),
    "env/hung_threads": ("a blocking environment call ran past env.timeout_s and never returned; its thread is left "
                         "to it and another serves the episodes (env/hung_threads)", 1),
}


def status(metrics: dict) -> str:
    """The progress line: reward, KL, and for episodes their turns, tool calls and parse errors, per episode."""
    parts = [f"reward {metrics['reward/mean']:.3f}"]
    if "kl" in metrics:
        parts.append(f"kl {metrics['kl']:.4f}")
    if "env/turns" in metrics:
        parts.append(f"turns {metrics['env/turns']:.1f}")
        parts += [f"{name} {metrics[key]:.2f}" for key, name in (("env/tool_calls", "tools"),
                                                                 ("env/parse_errors", "parse errors"))
                  if key in metrics]  # fmt: skip
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

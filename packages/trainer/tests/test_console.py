"""What a run shows: a progress line with the episodes' health (turns, tool calls, parse errors), and one warning the
first time every response of a step was cut at its limit or every episode ended on an unreadable tool call."""

import io

from rich.console import Console as RichConsole

from lorarl.trainer.console import Console, status


def steps(metrics: list[dict]) -> list[str]:
    out = io.StringIO()
    console = Console(RichConsole(file=out, width=200), steps=10,
                      hints={"env/stop/parse_error": "env.tool_format=compact"})  # fmt: skip
    for step, m in enumerate(metrics, 1):
        console.step_done(step, {"reward/mean": 0.0, "timing/step_s": 0.1, **m})
    return out.getvalue().splitlines()


def test_the_progress_line_shows_the_episodes_health():
    line = status({"reward/mean": 0.5, "timing/step_s": 0.25, "env/turns": 1.5, "env/tool_calls": 0.75,
                   "env/parse_errors": 0.125})  # fmt: skip
    assert line == "reward 0.500  turns 1.5  tools 0.75  parse errors 0.12  0.25 s/step"
    assert status({"reward/mean": 0.5, "timing/step_s": 0.25}) == "reward 0.500  0.25 s/step"  # single-turn


def test_a_step_that_learns_nothing_is_warned_of_once():
    lines = steps([{"env/stop/parse_error": 0.5}, {"env/stop/parse_error": 1.0}, {"env/stop/parse_error": 1.0},
                   {"response_length/truncated": 1.0}])  # fmt: skip
    assert lines == [
        "warning: step 2: every episode ended on a tool call its format could not read (env.tool_format=compact)",
        "warning: step 4: every response was cut at its token limit",
    ]

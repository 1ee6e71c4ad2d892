"""Ctrl-C (SIGINT) to a real `trainer` process: it finishes the step in progress, writes a checkpoint of it, shuts the
engine down and prints the command to resume — which repeats the uninterrupted run. A second Ctrl-C quits at once."""

import json
import shlex
import signal
import subprocess
import sys
import time

import pytest
from trainer_fixtures import tiny_overrides

from lorarl.trainer.cli import main

STEPS = 40


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def start(overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lorarl.trainer.cli", *overrides], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def wait_for_steps(out, process: subprocess.Popen, steps: int) -> None:
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").is_file() and len(records(out)) >= steps):
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_ctrl_c_checkpoints_the_last_step_and_the_printed_command_resumes_exactly(tiny_setup, tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert main(tiny_overrides(tiny_setup, straight, trainer__steps=STEPS)) == 0
    process = start(tiny_overrides(tiny_setup, interrupted, trainer__steps=STEPS))
    wait_for_steps(interrupted, process, 3)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, output
    assert "Ctrl-C: stopping after this step" in output
    stopped = records(interrupted)[-1]["step"]
    assert 3 <= stopped < STEPS
    assert f"stopped after step {stopped} (checkpoint written); resume with:" in output
    checkpoint = interrupted / "checkpoints" / f"step_{stopped}"
    assert (checkpoint / "trainer_state.pt").is_file()
    assert not list((interrupted / "checkpoints").glob(".incomplete-*"))
    command = shlex.split(output.strip().splitlines()[-1])
    assert command[:3] == ["uv", "run", "trainer"]
    assert "trainer.resume=auto" in command
    assert main(command[3:]) == 0  # the printed command, run
    expected = {r["step"]: r for r in records(straight)}
    resumed = records(interrupted)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for record in resumed[stopped:]:
        for key in ("reward/mean", "loss", "grad_norm", "entropy"):
            assert record[key] == pytest.approx(expected[record["step"]][key], rel=1e-5, abs=1e-7), key


def test_a_second_ctrl_c_quits_at_once(tiny_setup, tmp_path):
    out = tmp_path / "out"
    process = start(tiny_overrides(tiny_setup, out, trainer__steps=10_000))
    wait_for_steps(out, process, 1)
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 130, output
    assert len(records(out)) < 10_000

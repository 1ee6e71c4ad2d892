"""Ctrl-C (SIGINT) or SIGTERM to a real `trainer` process: it finishes the step in progress, writes a checkpoint of it,
shuts the engine down and prints the command to resume — which repeats the uninterrupted run. Also when the signal
goes to the whole process group of `uv run trainer` (what a terminal, a job scheduler or a supervisor does), which
delivers it twice: from the group, and forwarded by uv. A second signal, later, quits at once."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from trainer_fixtures import tiny_overrides

from lorarl.trainer.cli import main

STEPS = 40


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


ROOT = Path(__file__).resolve().parents[3]


def start(overrides: list[str], *, under_uv: bool = False) -> subprocess.Popen:
    """The trainer as its own process group (`uv run --no-sync trainer`, or this interpreter's `-m`)."""
    if under_uv:
        command = [shutil.which("uv"), "run", "--no-sync", "--project", str(ROOT), "trainer"]
        env = {**os.environ, "VIRTUAL_ENV": str(Path(sys.prefix))}
    else:
        command, env = [sys.executable, "-m", "lorarl.trainer.cli"], None
    return subprocess.Popen([*command, *overrides], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)  # fmt: skip


def wait_until(process: subprocess.Popen, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 120
    while not ready():
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.02)


def wait_for_steps(out, process: subprocess.Popen, steps: int) -> None:
    wait_until(process, lambda: (out / "metrics.jsonl").is_file() and len(records(out)) >= steps)


def test_ctrl_c_checkpoints_the_last_step_and_the_printed_command_resumes_exactly(tiny_setup, tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    # a fixed thread count: the runs repeat bit for bit whatever else the machine runs (lorarl.trainer.threads)
    assert main(tiny_overrides(tiny_setup, straight, trainer__steps=STEPS, trainer__threads=1)) == 0
    process = start(tiny_overrides(tiny_setup, interrupted, trainer__steps=STEPS, trainer__threads=1))
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


@pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv (CI installs it)")
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_process_group_under_uv_run_checkpoints_and_prints_the_resume_command(
    tiny_setup, tmp_path, signum, code
):
    out = tmp_path / "out"
    process = start(tiny_overrides(tiny_setup, out, trainer__steps=STEPS), under_uv=True)
    wait_for_steps(out, process, 2)
    os.killpg(process.pid, signum)  # the whole group: uv and the trainer
    output, _ = process.communicate(timeout=120)
    assert process.returncode == code, output
    stopped = records(out)[-1]["step"]
    assert 2 <= stopped < STEPS, output
    assert "interrupted" not in output
    assert f"stopped after step {stopped} (checkpoint written); resume with:" in output
    assert (out / "checkpoints" / f"step_{stopped}" / "trainer_state.pt").is_file()
    assert "trainer.resume=auto" in output.strip().splitlines()[-1]
    lines = output.splitlines()  # stdout and stderr in one stream, as a redirected log has them: in order
    notice = f"{'Ctrl-C' if signum == signal.SIGINT else 'SIGTERM'}: stopping after this step"
    where = [next(i for i, line in enumerate(lines) if line.startswith(start))
             for start in ("outputs: ", notice, f"stopped after step {stopped}")]  # fmt: skip
    assert where == sorted(where), output


def test_a_second_ctrl_c_quits_at_once(tiny_setup, tmp_path):
    out, slow, calls = tmp_path / "out", tmp_path / "slow.py", tmp_path / "calls"
    slow.write_text(
        "import time\n\n\ndef reward(prompt, response, answer):\n"
        f"    with open({str(calls)!r}, 'a') as f:\n        f.write('.')\n    time.sleep(0.1)\n    return 0.0\n"
    )
    process = start(tiny_overrides(tiny_setup, out, trainer__steps=10_000, reward__fn=f"{slow}:reward"))
    responses = 8 * 4  # data.batch_size x rollout.n: one step scores them one by one, 0.1 s each
    # step 2 has begun scoring, with >= 2.8 s of it left
    wait_until(process, lambda: calls.is_file() and len(calls.read_text()) >= responses + 4)
    process.send_signal(signal.SIGINT)
    time.sleep(1.5)  # later than a repeat of the same signal (uv forwarding it), within the step
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 130, output
    assert "interrupted" in output
    assert len(records(out)) == 1, output  # step 2 never finished

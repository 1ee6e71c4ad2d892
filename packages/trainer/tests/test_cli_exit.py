"""A torchrun rank leaves through `os._exit` (see `cli.run`): its exit code, its buffered output and its exit handlers
must survive that."""

import os
import subprocess
import sys

import pytest

RANK = """
import atexit, sys
atexit.register(lambda: print("exit handler ran"))
sys.argv = ["trainer", *sys.argv[1:]]
from lorarl.trainer.cli import run
run()
"""
CASES = [(["--help"], 0, "usage: trainer"), (["a.yaml", "b.yaml"], 2, "at most one config file")]


@pytest.mark.parametrize("world", ["1", "2"])
@pytest.mark.parametrize(("args", "code", "printed"), CASES)
def test_a_rank_keeps_its_exit_code_output_and_exit_handlers(world, args, code, printed):
    env = {**os.environ, "WORLD_SIZE": world}
    done = subprocess.run([sys.executable, "-c", RANK, *args], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == code, done.stderr
    assert printed in done.stdout  # a pipe: block-buffered, lost unless flushed before os._exit
    assert done.stdout.rstrip().endswith("exit handler ran")

"""Every benchmark runs from a fresh checkout as its docstring says: its arguments parse (`--help`), and the data it
prepares without the network is written into folders that do not exist yet (multiturn_vs_trl.py's recipe task once
failed there with FileNotFoundError)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("packages/*/benchmarks/*.py")])


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_a_benchmark_s_arguments_parse(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def benchmark_module(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))  # they import each other, as scripts run from their folder do
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_multiturn_vs_trl_writes_its_task_into_a_fresh_folder(tmp_path):
    module = benchmark_module("multiturn_vs_trl")
    data, work = tmp_path / "outputs" / "smollm2", tmp_path / "work"  # neither exists: a fresh checkout's
    work.mkdir()
    module.write_task(data, work)
    rows = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 20000
    assert rows[0]["prompt"][0]["content"] == module.SYSTEM
    assert (data / "multiply_val.jsonl").is_file()

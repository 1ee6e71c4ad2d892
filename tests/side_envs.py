"""Environments of their own beside the project's (vLLM's CPU build, verifiers v1, the Tinker cookbook): made — or
made again when what they are made from changed — by their script, which records a digest of its inputs in
`lorarl-inputs`."""

import hashlib
import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ensure_environment(env: Path, script: Path, inputs: list[Path], *options: str) -> Path:
    """`env`'s Python, after `script` (with `options`) made the environment again if its `inputs` changed since."""
    stamp = env / "lorarl-inputs"
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in inputs)).hexdigest()
    if not stamp.exists() or stamp.read_text().strip() != digest:
        subprocess.run([script, env, *options], check=True, timeout=1800, env=outside_env())
    return env / "bin" / "python"


def vllm_environment(env: Path, *options: str) -> Path:
    """`env`'s Python: an environment `scripts/vllm_cpu_env.sh` makes (with `options`), made again when the script
    or a package's dependencies changed."""
    script = ROOT / "scripts" / "vllm_cpu_env.sh"
    return ensure_environment(env, script, [script, *sorted(ROOT.glob("packages/*/pyproject.toml"))], *options)


def outside_env() -> dict[str, str]:
    """This process's environment without this project's virtual environment in it (`uv run` puts it first on PATH
    and in VIRTUAL_ENV: processes of another environment, Ray's workers among them, would start its Python)."""
    venv = os.environ.get("VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV" and not k.startswith("UV_")}
    if venv:
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(venv))
    return env


def run_side_tests(python: Path, tests: str, min_tests: int, report: Path, what: str) -> None:
    """`tests` (a folder of this checkout) run by `python`'s pytest, in one process (this suite's other workers run
    beside it), where they never skip: a skipped test fails as a failed one does, and so does a run that collected
    fewer than `min_tests` (it lost some)."""
    where = subprocess.run([python, "-c", "import lorarl.weight_sync; print(lorarl.weight_sync.__file__)"],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert Path(where.strip()).is_relative_to(ROOT), f"{python} holds the packages of another checkout: {where}"
    command = [python, "-m", "pytest", tests, "-n", "0", "-p", "no:cacheprovider", "-q", "-rfs", f"--junitxml={report}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3000, env=outside_env())
    summary = ET.parse(report).getroot().find("testsuite").attrib if report.exists() else {}
    tail = (done.stdout + done.stderr)[-8000:]
    assert done.returncode == 0, f"the {what} tests failed:\n{tail}"
    assert int(summary["skipped"]) == 0, f"{what} tests were skipped:\n{tail}"
    assert int(summary["tests"]) >= min_tests, f"only {summary['tests']} {what} tests ran:\n{tail}"

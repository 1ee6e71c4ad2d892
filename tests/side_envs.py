"""Environments of their own beside the project's (vLLM's CPU build, the Tinker cookbook): made — or made again when
what they are made from changed — by their script, which records a digest of its inputs in `lorarl-inputs`."""

import hashlib
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ensure_environment(env: Path, script: Path, inputs: list[Path]) -> Path:
    """`env`'s Python, after `script` made the environment again if its `inputs` changed since."""
    stamp = env / "lorarl-inputs"
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in inputs)).hexdigest()
    if not stamp.exists() or stamp.read_text().strip() != digest:
        subprocess.run([script, env], check=True, timeout=1800, env=outside_env())
    return env / "bin" / "python"


def outside_env() -> dict[str, str]:
    """This process's environment without this project's virtual environment in it (`uv run` puts it first on PATH
    and in VIRTUAL_ENV: processes of another environment, Ray's workers among them, would start its Python)."""
    venv = os.environ.get("VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV" and not k.startswith("UV_")}
    if venv:
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(venv))
    return env

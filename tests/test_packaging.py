"""Each package builds a wheel of its own with the PEP 420 `lorarl` namespace, and installs alone."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "padding": "lorarl_padding",
    "lora_merge": "lorarl_lora_merge",
    "weight_sync": "lorarl_weight_sync",
    "trainer": "lorarl_trainer",
}


def uv() -> str:
    """The uv binary: `uv run` exports it as $UV; the README's test command always goes through uv."""
    found = os.environ.get("UV") or shutil.which("uv")
    assert found, "uv not found: run the tests with `uv run pytest`"
    return found


def build_wheel(package: str, out_dir: Path) -> Path:
    subprocess.run(
        [uv(), "build", "--wheel", "--quiet", "--out-dir", str(out_dir), str(ROOT / "packages" / package)],
        check=True,
        timeout=300,
    )
    (wheel,) = out_dir.glob(f"{PACKAGES[package]}-*.whl")
    return wheel


@pytest.mark.parametrize("package", PACKAGES)
def test_wheel_ships_its_subpackage_in_the_lorarl_namespace(package, tmp_path):
    names = zipfile.ZipFile(build_wheel(package, tmp_path)).namelist()
    assert f"lorarl/{package}/__init__.py" in names
    assert "lorarl/__init__.py" not in names  # a namespace: the four wheels must not collide
    others = [n for n in names if n.startswith("lorarl/") and not n.startswith(f"lorarl/{package}/")]
    assert others == []


def test_padding_installs_alone_into_a_fresh_venv(tmp_path):
    wheel = build_wheel("padding", tmp_path / "dist")
    venv = tmp_path / "venv"
    subprocess.run([uv(), "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # the lock's versions, so that this installs from uv's cache instead of resolving anew
    constraints = tmp_path / "constraints.txt"
    exported = subprocess.run(
        [uv(), "export", "--quiet", "--frozen", "--no-hashes", "--no-emit-workspace", "--package", "lorarl-padding"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    constraints.write_text(exported.stdout)
    subprocess.run(
        [uv(), "pip", "install", "--quiet", "--python", str(python), "-c", str(constraints), str(wheel)],
        check=True,
        timeout=600,
    )
    probe = "import lorarl.padding as p, torch; b = p.left_right_pad([[1]], [[2, 3]]); print(b.input_ids.tolist())"
    result = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "[[1, 2, 3]]"
    site = subprocess.run(
        [str(python), "-c", "import lorarl, sys; print(list(lorarl.__path__))"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert str(ROOT) not in site.stdout  # the wheel's copy, not the workspace checkout

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


def test_lora_merge_wheel_carries_the_op_sources(tmp_path):
    names = zipfile.ZipFile(build_wheel("lora_merge", tmp_path)).namelist()
    for source in ("lora_merge_ops.cpp", "lora_merge_cpu.cpp", "lora_merge_cuda.cu", "lora_merge_checks.h"):
        assert f"lorarl/lora_merge/csrc/{source}" in names


PROBES = {
    "padding": "import lorarl.padding as p; print(p.left_right_pad([[1]], [[2, 3]]).input_ids.tolist())",
    # builds the C++ op from the sources inside the installed wheel
    "lora_merge": "import torch; from lorarl.lora_merge import merge_lora; "
    "print(merge_lora(torch.ones(2, 3), torch.ones(1, 3), torch.ones(2, 1), 2.0, backend='cpp').tolist())",
}
EXPECTED = {"padding": "[[1, 2, 3]]", "lora_merge": "[[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]"}


@pytest.mark.parametrize("package", PROBES)
def test_package_installs_alone_into_a_fresh_venv(package, tmp_path):
    wheel = build_wheel(package, tmp_path / "dist")
    venv = tmp_path / "venv"
    subprocess.run([uv(), "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # the lock's versions, so that this installs from uv's cache instead of resolving anew
    exported = subprocess.run(
        [
            uv(),
            "export",
            "--quiet",
            "--frozen",
            "--no-hashes",
            "--no-emit-workspace",
            "--package",
            f"lorarl-{package.replace('_', '-')}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(exported.stdout)
    subprocess.run(
        [uv(), "pip", "install", "--quiet", "--python", str(python), "-c", str(constraints), str(wheel)],
        check=True,
        timeout=600,
    )
    env = os.environ | {"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}  # a build of its own, not the dev one's
    probe = f"{PROBES[package]}; import lorarl; print(list(lorarl.__path__))"
    result = subprocess.run(
        [str(python), "-W", "ignore", "-c", probe], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output, namespace_path = result.stdout.strip().splitlines()[-2:]
    assert output == EXPECTED[package]
    assert str(ROOT) not in namespace_path  # the wheel's copy, not the workspace checkout

"""Each package builds a wheel of its own with the PEP 420 `lorarl` namespace, and installs alone."""

import os
import shutil
import subprocess
import sys
import tarfile
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


SOURCES = ("lora_merge_ops.cpp", "lora_merge_cpu.cpp", "lora_merge_cuda.cu", "lora_merge_checks.h")


def build_from_sdist(out_dir: Path) -> tuple[Path, Path]:
    """lorarl-lora-merge's sdist, and the wheel built from that sdist alone (uv builds it in isolation, from the
    unpacked sdist: the checkout's csrc/ out of reach)."""
    package = ROOT / "packages" / "lora_merge"
    subprocess.run([uv(), "build", "--sdist", "--quiet", "--out-dir", str(out_dir), str(package)], check=True,
                   timeout=300)  # fmt: skip
    (sdist,) = out_dir.glob("lorarl_lora_merge-*.tar.gz")
    wheels = out_dir / "from-sdist"
    subprocess.run([uv(), "build", "--wheel", "--quiet", "--out-dir", str(wheels), str(sdist)], check=True,
                   timeout=300)  # fmt: skip
    (wheel,) = wheels.glob("lorarl_lora_merge-*.whl")
    return sdist, wheel


def test_lora_merge_sdist_and_the_wheel_built_from_it_carry_the_op_sources(tmp_path):
    sdist, wheel = build_from_sdist(tmp_path)
    with tarfile.open(sdist) as archive:
        in_sdist = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {f"csrc/{source}" for source in SOURCES} <= in_sdist
    in_wheel = zipfile.ZipFile(wheel).namelist()
    assert {f"lorarl/lora_merge/csrc/{source}" for source in SOURCES} <= set(in_wheel)


PROBES = {
    "padding": "import lorarl.padding as p; print(p.left_right_pad([[1]], [[2, 3]]).input_ids.tolist())",
    # builds the C++ op from the sources inside the installed wheel; against a float64 merge (one rounding)
    "lora_merge": "import torch; from lorarl.lora_merge import merge_lora; g = torch.Generator().manual_seed(0); "
    "w, a, b = torch.randn(96, 80, generator=g), torch.randn(8, 80, generator=g), torch.randn(96, 8, generator=g); "
    "exact = (w.double() + 0.5 * b.double() @ a.double()).float(); "
    "print((merge_lora(w, a, b, 0.5, backend='cpp') - exact).abs().max().item() <= 1e-6 * exact.abs().max().item())",
}
EXPECTED = {"padding": "[[1, 2, 3]]", "lora_merge": "True"}


def install(wheel: Path, package: str, venv: Path) -> Path:
    """A fresh venv holding `wheel` and its dependencies at the lock's versions (installed from uv's cache instead of
    resolved anew); returns its python."""
    subprocess.run([uv(), "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    exported = subprocess.run(
        [uv(), "export", "--quiet", "--frozen", "--no-hashes", "--no-emit-workspace", "--package",
         f"lorarl-{package.replace('_', '-')}"],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    constraints = venv / "constraints.txt"
    constraints.write_text(exported.stdout)
    subprocess.run([uv(), "pip", "install", "--quiet", "--python", str(python), "-c", str(constraints), str(wheel)],
                   check=True, timeout=600)  # fmt: skip
    return python


def probe(python: Path, package: str, extensions: Path, cwd: Path) -> tuple[str, str]:
    """The package's probe in that python (its op built under `extensions`, not the dev one's), and where the
    `lorarl` namespace came from."""
    env = os.environ | {"TORCH_EXTENSIONS_DIR": str(extensions)}
    code = f"{PROBES[package]}; import lorarl; print(list(lorarl.__path__))"
    result = subprocess.run([str(python), "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=600,
                            env=env, cwd=cwd)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    output, namespace_path = result.stdout.strip().splitlines()[-2:]
    return output, namespace_path


def test_padding_installs_alone_into_a_fresh_venv(tmp_path):
    python = install(build_wheel("padding", tmp_path / "dist"), "padding", tmp_path / "venv")
    output, namespace_path = probe(python, "padding", tmp_path / "extensions", tmp_path)
    assert output == EXPECTED["padding"]
    assert str(ROOT) not in namespace_path  # the wheel's copy, not the workspace checkout


@pytest.mark.starts_first
def test_lora_merge_from_its_sdist_installs_alone_and_two_environments_share_one_build_of_its_op(tmp_path):
    _, wheel = build_from_sdist(tmp_path / "dist")
    extensions = tmp_path / "extensions"
    first = install(wheel, "lora_merge", tmp_path / "venv-a")
    output, namespace_path = probe(first, "lora_merge", extensions, tmp_path)
    assert output == EXPECTED["lora_merge"]  # the C++ op, built from the wheel's sources, against float64
    assert str(ROOT) not in namespace_path
    (digest,) = extensions.iterdir()  # one directory, named by the digest of the sources and the builds
    libraries = sorted(digest.rglob("*.so"))  # the build's and the one published beside it
    built = [library.stat().st_mtime_ns for library in libraries]
    second = install(wheel, "lora_merge", tmp_path / "venv-b")  # another environment: sources and torch elsewhere
    assert probe(second, "lora_merge", extensions, tmp_path)[0] == EXPECTED["lora_merge"]
    assert list(extensions.iterdir()) == [digest]  # found, not built again beside it ...
    assert [library.stat().st_mtime_ns for library in sorted(digest.rglob("*.so"))] == built  # ... nor in it

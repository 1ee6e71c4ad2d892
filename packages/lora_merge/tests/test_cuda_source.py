"""The CUDA kernel cannot run here (no GPU), but its source must compile with nvcc against this torch."""

import shutil
import subprocess
import sysconfig

import pytest
from torch.utils import cpp_extension

from lorarl.lora_merge._cpp_backend import CUDA_SOURCES, sources_dir


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed on this machine")
def test_cuda_kernel_compiles(tmp_path):
    includes = [*cpp_extension.include_paths(), str(sources_dir()), sysconfig.get_paths()["include"]]
    for source in CUDA_SOURCES:
        command = [
            "nvcc", "-c", "-std=c++20", "-O3", "-arch=sm_90", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr",
            *(f"-I{path}" for path in includes),
            str(sources_dir() / source), "-o", str(tmp_path / "kernel.o"),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / "kernel.o").stat().st_size > 0

"""The C++/CUDA op from `csrc/`, JIT-built with ninja on first use and cached by torch's extension builder."""

import functools
import logging
import os
import platform
from pathlib import Path

import torch

CPU_SOURCES = ("lora_merge_ops.cpp", "lora_merge_cpu.cpp")
CUDA_SOURCES = ("lora_merge_cuda.cu",)


def sources_dir() -> Path:
    """`csrc/`: shipped inside the wheel, or at the root of a source checkout (editable install)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", *(parent / "csrc" for parent in here.parents)):
        if (candidate / CPU_SOURCES[0]).is_file():
            return candidate
    raise FileNotFoundError(f"lorarl.lora_merge: the op's sources ({CPU_SOURCES[0]}) are missing near {here}")


@functools.cache
def load_op(with_cuda: bool) -> None:
    """Build (first time only) and load the op into `torch.ops.lorarl`; CUDA kernels only when asked for."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # not "No CUDA runtime" on every CPU run
    from torch.utils import cpp_extension

    try:  # the `ninja` wheel puts its binary next to the venv's python, which may not be on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    src = sources_dir()
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())
    # The CPU the op runs on, unless LORARL_MERGE_MARCH names another target (e.g. x86-64-v3: AVX2, no AVX-512) to
    # build a portable op or test the kernel's path for narrower vectors; each target gets its own build.
    march = os.environ.get("LORARL_MERGE_MARCH", "native")
    cpu_flags = ["-O3", f"-march={march}", "-ffp-contract=fast", "-fopenmp"]
    if platform.machine().lower() in ("x86_64", "amd64"):  # an x86-only option: GCC for ARM rejects it
        cpu_flags.append("-mprefer-vector-width=512")
    suffix = "" if march == "native" else "_" + "".join(c if c.isalnum() else "_" for c in march)
    cpp_extension.load(
        name=("lorarl_lora_merge_cuda" if with_cuda else "lorarl_lora_merge_cpu") + suffix,
        sources=[str(src / name) for name in names],
        extra_cflags=cpu_flags,
        extra_cuda_cflags=["-O3"] if with_cuda else None,  # no fast math: it flushes denormal weights to zero
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(src)],
        is_python_module=False,
        verbose=False,
    )


def merge(weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """`out = weight + scale * left @ right` with the compiled op (contiguous `weight` and `out`)."""
    load_op(weight.is_cuda)
    torch.ops.lorarl.merge_lora(weight, left, right, scale, out)

"""The C++/CUDA op from `csrc/`, JIT-built with ninja on first use, once per source digest and build: the sources
are staged under a directory named by the digest of their contents, the flags, and the Python, torch and CUDA builds
(in torch's extension cache, or `TORCH_EXTENSIONS_DIR`), built there, and the library published beside them; any
checkout or environment with the same sources and builds loads that library without building (torch's cache, keyed
by name with the paths of the sources and of torch itself in its build commands, rebuilt whenever another checkout or
environment had run last); different ones keep one directory each."""

import functools
import hashlib
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

CPU_SOURCES = ("lora_merge_ops.cpp", "lora_merge_cpu.cpp")
CUDA_SOURCES = ("lora_merge_cuda.cu",)
HEADERS = ("lora_merge_checks.h",)


def sources_dir() -> Path:
    """`csrc/`: shipped inside the wheel, or at the root of the source checkout (an editable install)."""
    here = Path(__file__).resolve().parent
    checkout = here.parents[min(4, len(here.parents) - 1)]  # <root>/packages/lora_merge/src/lorarl/lora_merge
    candidates = (here / "csrc", checkout / "csrc")
    for candidate in candidates:
        if (candidate / CPU_SOURCES[0]).is_file():
            return candidate
    raise FileNotFoundError(f"lorarl.lora_merge: the op's sources ({CPU_SOURCES[0]}) are in neither "
                            f"{candidates[0]} (a wheel) nor {candidates[1]} (a checkout)")  # fmt: skip


def cpu_flags(march: str) -> list[str]:
    flags = ["-O3", f"-march={march}", "-ffp-contract=fast", "-fopenmp"]
    if platform.machine().lower() in ("x86_64", "amd64"):  # an x86-only option: GCC for ARM rejects it
        flags.append("-mprefer-vector-width=512")
    return flags


def staged_build(with_cuda: bool, march: str) -> tuple[str, Path, list[Path]]:
    """The op's build name, its build directory (named by the digest of everything the build depends on), and its
    sources staged in that directory (so that the build's commands are the same from any checkout)."""
    src = sources_dir()
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ()) + HEADERS
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0" + (src / name).read_bytes() + b"\0")
    build = (sys.version, torch.__version__, torch.version.cuda, march, *cpu_flags(march), with_cuda)
    digest.update(repr(build).encode())
    name = f"lorarl_lora_merge_{'cuda' if with_cuda else 'cpu'}_{digest.hexdigest()[:16]}"
    from torch.utils import cpp_extension

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    directory = root / name
    staged = directory / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for source in names:
        target = staged / source
        if not target.is_file() or target.read_bytes() != (src / source).read_bytes():
            with tempfile.NamedTemporaryFile(dir=staged, delete=False) as part:  # whole or not at all
                part.write((src / source).read_bytes())
            os.replace(part.name, target)
    return name, directory, [staged / n for n in names if not n.endswith(".h")]


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
    # The CPU the op runs on, unless LORARL_MERGE_MARCH names another target (e.g. x86-64-v3: AVX2, no AVX-512) to
    # build a portable op or test the kernel's path for narrower vectors; each target gets its own build.
    march = os.environ.get("LORARL_MERGE_MARCH", "native")
    name, directory, sources = staged_build(with_cuda, march)
    published = directory / f"{name}.so"
    if published.is_file():  # built before, from the same sources for the same builds: from any checkout
        torch.ops.load_library(str(published))
        return
    build = directory / "build"
    build.mkdir(exist_ok=True)
    print(f"lorarl.lora_merge: building its {'CUDA' if with_cuda else 'C++'} merge op for this machine, once (cached "
          f"in {directory})...", file=sys.stderr, flush=True)  # fmt: skip
    started = time.perf_counter()
    cpp_extension.load(
        name=name,
        sources=[str(path) for path in sources],
        extra_cflags=cpu_flags(march),
        extra_cuda_cflags=["-O3"] if with_cuda else None,  # no fast math: it flushes denormal weights to zero
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(sources[0].parent)],
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    with tempfile.NamedTemporaryFile(dir=directory, delete=False) as part:  # published whole or not at all
        part.write((build / published.name).read_bytes())
    os.chmod(part.name, 0o755)
    os.replace(part.name, published)
    print(f"lorarl.lora_merge: built in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)


def merge(weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """`out[e] = weight[e] + scale * left[e] @ right[e]` for each expert e of the 3-D tensors (a dense merge is a group
    of one) with the compiled op (contiguous `weight` and `out`)."""
    load_op(weight.is_cuda)
    torch.ops.lorarl.merge_lora(weight, left, right, scale, out)

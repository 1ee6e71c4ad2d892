"""`merge_lora`: `W + scale * (B @ A)` out of place, fp32 accumulation, one rounding, no full-size temporary;
`merge_lora_grouped`: the same for every expert of a mixture of experts at once, in one call of the same kernels.

Backends: "triton" (CUDA tensors, or CPU under TRITON_INTERPRET=1), "cpp" (the C++/CUDA op from csrc/, JIT-built),
"torch" (fp32 addmm on row tiles, the readable reference) and "auto" (Triton on CUDA, the C++ op on CPU, falling back
to torch when the op cannot be built, e.g. without a C++ compiler).
"""

import functools
import numbers
import warnings
from collections.abc import Callable

import torch

from lorarl.lora_merge import _cpp_backend, _torch_backend
from lorarl.lora_merge._output import empty_output

BACKENDS = ("auto", "triton", "cpp", "torch")
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor], None]


def merge_lora(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    fan_in_fan_out: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """`weight + scale * (lora_B @ lora_A)` (transposed when `fan_in_fan_out`), rounded once to `out`'s dtype.

    Shapes are peft's: `weight [out, in]` (`[in, out]` with `fan_in_fan_out`, GPT-2's Conv1D), `lora_A [r, in]`,
    `lora_B [out, r]`. `weight` is never modified unless `out is weight`. `out` defaults to a new tensor like
    `weight`; it may have another float dtype (e.g. an fp32 master weight merged straight into bf16).
    """
    return _merge(weight, lora_A, lora_B, scale, out, fan_in_fan_out, backend, grouped=False)


def merge_lora_grouped(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    transposed: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Every expert of a mixture at once: `weight[e] + scale * (lora_B[e] @ lora_A[e])` for each `e` (transposed
    when `transposed`), in one call of one kernel, rounded once to `out`'s dtype, as `merge_lora` is per matrix.

    Shapes: `weight [E, out, in]` (`[E, in, out]` when `transposed`, as gpt-oss stores its experts), `lora_A [E, r,
    in]`, `lora_B [E, out, r]`; factors may be strided views (peft's flat expert layout read in place). `out` and
    `weight` as in `merge_lora`.
    """
    return _merge(weight, lora_A, lora_B, scale, out, transposed, backend, grouped=True)


def _merge(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float, out: torch.Tensor | None,
           transposed: bool, backend: str, *, grouped: bool) -> torch.Tensor:  # fmt: skip
    """Both merges: the kernels see a group of experts (3-D tensors), a dense merge as a group of one."""
    dims = 3 if grouped else 2
    _check_tensor(weight, "weight", dims, WEIGHT_DTYPES)
    _check_tensor(lora_A, "lora_A", dims)
    _check_tensor(lora_B, "lora_B", dims)
    experts = (weight.shape[0],) if grouped else ()
    rows, cols = weight.shape[-2:]
    fan_in, fan_out = (rows, cols) if transposed else (cols, rows)
    rank = lora_A.shape[-2]
    flag = (" (transposed)" if grouped else " (fan_in_fan_out)") if transposed else ""
    if lora_A.shape[:-2] != experts or lora_A.shape[-1] != fan_in:
        shape = ", ".join(map(str, [*experts, "r", fan_in]))
        raise ValueError(f"lora_A must have shape [{'E, ' if grouped else ''}r, in] = [{shape}] for weight "
                         f"{tuple(weight.shape)}{flag}, got {tuple(lora_A.shape)}")  # fmt: skip
    if lora_B.shape != (*experts, fan_out, rank):
        shape = ", ".join(map(str, [*experts, fan_out, rank]))
        raise ValueError(f"lora_B must have shape [{'E, ' if grouped else ''}out, r] = [{shape}] (rank from lora_A), "
                         f"got {tuple(lora_B.shape)}")  # fmt: skip
    for name, t in (("lora_A", lora_A), ("lora_B", lora_B)):
        if t.device != weight.device:
            raise ValueError(f"{name} is on {t.device} but weight is on {weight.device}")
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    if out is None:
        out = empty_output(weight.shape, weight.dtype, weight.device)
    else:
        _check_tensor(out, "out", dims, WEIGHT_DTYPES)
        if out.shape != weight.shape or out.device != weight.device:
            raise ValueError(
                f"out must have weight's shape {tuple(weight.shape)} and device {weight.device}, "
                f"got {tuple(out.shape)} on {out.device}"
            )
        for name, t in (("weight", weight), ("lora_A", lora_A), ("lora_B", lora_B)):
            if _overlaps(out, t) and not (name == "weight" and _same_view(out, weight)):
                raise ValueError(f"out overlaps {name} in memory (only out=weight, the very same tensor, is allowed)")

    left, right = (lora_A.mT, lora_B.mT) if transposed else (lora_B, lora_A)
    source = weight.contiguous()
    target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    if rank == 0 or weight.numel() == 0:
        target.copy_(source)
    elif grouped:
        _kernel(backend, weight.device)(source, left, right, float(scale), target)
    else:
        _kernel(backend, weight.device)(source[None], left[None], right[None], float(scale), target[None])
    if target is not out:
        out.copy_(target)  # non-contiguous out: computed contiguously, then copied (exact, same dtype)
    return out


def merge_lora_(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float, **kwargs
) -> torch.Tensor:
    """In place: `weight += scale * (lora_B @ lora_A)` with one rounding; returns `weight`."""
    return merge_lora(weight, lora_A, lora_B, scale, out=weight, **kwargs)


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """The backends that can run on `device` here (building the C++ op if needed)."""
    device = torch.device(device)
    found = ["torch"]
    if _cpp_op_builds(device.type == "cuda"):
        found.append("cpp")
    if device.type == "cuda" or _triton_interpreting():
        found.append("triton")
    return found


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16): the C++ op built for it then multiplies
    bf16 factors of an even rank in pairs, and torch's bf16 GEMM runs at about twice the fp32 rate.
    (`torch.cpu.get_capabilities` came with torch 2.11; before it, torch's own AVX512-BF16 probe answers.)"""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is None:
        return bool(torch.cpu._is_avx512_bf16_supported())  # every AMX-BF16 CPU has AVX512-BF16 too
    found = capabilities()
    return bool(found.get("avx512_bf16") or found.get("amx_bf16"))


def _kernel(backend: str, device: torch.device) -> Kernel:
    if backend == "torch":
        return _torch_backend.merge
    if backend == "cpp":
        return _cpp_backend.merge
    if backend == "triton":
        if device.type != "cuda" and not _triton_interpreting():
            raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 to test on CPU)")
        from lorarl.lora_merge import _triton_backend

        return _triton_backend.merge
    # auto: Triton on CUDA where it is installed (the fastest there); else the C++ op, on CPU and on CUDA without
    # Triton (torch builds that ship none, e.g. on Windows); else the torch reference
    cuda = device.type == "cuda"
    if cuda and _triton_installed():
        return _kernel("triton", device)
    if _cpp_op_builds(cuda):
        return _cpp_backend.merge
    return _torch_backend.merge


def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _triton_interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _cpp_op_builds(with_cuda: bool) -> bool:
    try:
        _cpp_backend.load_op(with_cuda)
    except Exception as e:  # no compiler, no ninja, ...: "auto" falls back to torch, loudly
        warnings.warn(f"lorarl.lora_merge: the C++ op could not be built ({e}); using the torch backend", stacklevel=3)
        return False
    return True


def _check_tensor(t: object, name: str, dims: int, dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() != dims:
        what = "3-D (experts, rows, columns)" if dims == 3 else "2-D"
        raise ValueError(f"{name} must be {what}, got shape {tuple(t.shape)}")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    if t.is_contiguous():  # the usual case, 4x cheaper: the overlap checks took 8 of a 64x64 merge call's 19 us
        return start, start + t.nbytes
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a.device == b.device and a0 < b1 and b0 < a1


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.dtype == b.dtype

"""The Triton kernel (GPU path), also runnable on CPU under TRITON_INTERPRET=1 for testing.

Each program loads one `BLOCK_M x BLOCK_N` tile of W (first, so the load is in flight while the product is
computed), accumulates `left_tile @ right_tile` over the rank in fp32 with `tl.dot`, adds, rounds once and writes the
tile to `out` (which may be W itself).

Precision: 16-bit factors go into `tl.dot` as they are (exact products, fp32 accumulation). fp32 factors (peft's
default) are split into bf16 parts on the tensor cores, because plain fp32 FMAs at rank 128 take several times longer
than the copy: "bf16x6" (products within ~2^-24, fp32's own rounding), or "bf16x3" (within ~2^-16.4, half the tensor
work) for bf16 outputs at rank >= 128, where that is no worse than the error bound of fp32 accumulation over so many
products (at lower ranks it broke the 1-ulp rule at cancellations, measured on an H100); never TF32. Under the
interpreter, `tl.dot` on bf16 returns garbage (triton#11584) and its bf16 cast truncates, so there everything is
computed in fp32 ("ieee") and the one rounding is done by torch.
"""

import functools
import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _merge_kernel(
    w_ptr,
    out_ptr,
    left_ptr,
    right_ptr,
    m,
    n,
    r,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    mask = (rows[:, None] < m) & (cols[None, :] < n)
    offsets = rows64[:, None] * n + cols[None, :]
    w = tl.load(w_ptr + offsets, mask=mask, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, r, BLOCK_R):
        ks = k0 + tl.arange(0, BLOCK_R)
        left = tl.load(
            left_ptr + rows64[:, None] * r + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < r), other=0.0
        )
        right = tl.load(
            right_ptr + ks[:, None].to(tl.int64) * n + cols[None, :],
            mask=(ks[:, None] < r) & (cols[None, :] < n),
            other=0.0,
        )
        acc = tl.dot(left, right, acc, input_precision=PRECISION)
    tl.store(out_ptr + offsets, (w.to(tl.float32) + scale * acc).to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _autotuned():
    """The kernel autotuned over tile sizes, for real GPUs (the interpreter runs one small fixed tile)."""
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
        for bm, bn, warps, stages in [
            (64, 64, 4, 2),
            (64, 128, 4, 3),
            (128, 64, 4, 3),
            (128, 128, 8, 3),
            (64, 256, 8, 3),
            (128, 256, 8, 2),
            (128, 256, 8, 3),
            (256, 128, 8, 2),
        ]
    ]
    return triton.autotune(
        configs=configs,
        key=["m", "n", "r", "PRECISION"],
        prune_configs_by={"early_config_prune": _fitting_tiles},
        restore_value=["out_ptr"],  # timing a config runs the merge: in place (out is W), W must not change
    )(_merge_kernel)


def _fitting_tiles(configs: list, named_args: dict, **kwargs) -> list:
    """Tiles no larger than the layer needs: a 5 x 70 layer is not worth compiling and timing 256 x 128 tiles for."""
    return [  # the 64 x 64 tile always fits
        c
        for c in configs
        if c.kwargs["BLOCK_M"] <= max(64, triton.next_power_of_2(named_args["m"]))
        and c.kwargs["BLOCK_N"] <= max(64, triton.next_power_of_2(named_args["n"]))
    ]


TWO_PARTS_FROM_RANK = 128  # where fp32 accumulation's own error bound, (r + 2)·2^-24, reaches bf16x3's ~2^-16.4


def dot_precision(factor_dtype: torch.dtype, out_dtype: torch.dtype, rank: int) -> str:
    """How `tl.dot` multiplies the factors: exactly where they are 16-bit, else split into bf16 parts (see above)."""
    if interpreting() or factor_dtype != torch.float32:
        return "ieee"  # 16-bit factors: exact products whatever the mode; the interpreter: plain fp32
    return "bf16x3" if out_dtype == torch.bfloat16 and rank >= TWO_PARTS_FROM_RANK else "bf16x6"


def merge(weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """`out = weight + scale * left @ right` with the Triton kernel (contiguous `weight` and `out`)."""
    m, n = weight.shape
    r = left.shape[1]
    factor_dtype = torch.promote_types(left.dtype, right.dtype)
    if interpreting() or factor_dtype not in (torch.bfloat16, torch.float16):
        factor_dtype = torch.float32
    precision = dot_precision(factor_dtype, out.dtype, r)
    left = left.to(factor_dtype).contiguous()
    right = right.to(factor_dtype).contiguous()
    block_r = max(16, min(64, triton.next_power_of_2(r)))
    if interpreting():
        staged = torch.empty(m, n, dtype=torch.float32, device=weight.device)
        grid = (triton.cdiv(m, 32), triton.cdiv(n, 32))
        _merge_kernel[grid](
            weight, staged, left, right, m, n, r, scale, BLOCK_M=32, BLOCK_N=32, BLOCK_R=block_r, PRECISION=precision
        )
        out.copy_(staged)  # the one rounding, done by torch (the interpreter's bf16 cast truncates)
        return
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    _autotuned()[grid](weight, out, left, right, m, n, r, scale, BLOCK_R=block_r, PRECISION=precision)

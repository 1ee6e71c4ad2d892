"""The Triton kernel (GPU path), also runnable on CPU under TRITON_INTERPRET=1 for testing.

Each program loads one `BLOCK_M x BLOCK_N` tile of W (early, so the load is in flight while the product is
computed), computes `left_tile @ right_tile` in fp32 with `tl.dot`, adds, rounds once and writes the tile to `out`
(which may be W itself); a group of experts is one launch, the grid's third axis the expert. Ranks up to 128 (nearly
every adapter) take one `tl.dot` with no loop around it: on an H100 that alone lifted the merge from 0.71 to 0.85 of
copy bandwidth (bf16 W, rank 8), the loop's scheduling costing more than its one iteration; larger ranks are walked
in chunks of 128.

Precision: 16-bit factors go into `tl.dot` as they are (exact products, fp32 accumulation). fp32 factors (peft's
default) are split into bf16 parts on the tensor cores, because plain fp32 FMAs at rank 128 take several times longer
than the copy: "bf16x6" (products within ~2^-24, fp32's own rounding), or "bf16x3" (within ~2^-16.4, half the tensor
work) for bf16 outputs at rank >= 128, where that is no worse than the error bound of fp32 accumulation over so many
products (at lower ranks it broke the 1-ulp rule at cancellations, measured on an H100); never TF32. Under the
interpreter, `tl.dot` on bf16 returns garbage (triton#11584) and its bf16 cast truncates, so there everything is
computed in fp32 ("ieee") and the one rounding is done by torch.
"""

import os

import torch
import triton
import triton.language as tl

MAX_BLOCK_R = 128  # ranks up to this go into one `tl.dot`; larger ones in chunks of it


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _left_chunk(left_ptr, rows, m, r, k0, BLOCK_R: tl.constexpr):
    """left[rows, k0 : k0 + BLOCK_R], zero outside the matrix."""
    ks = k0 + tl.arange(0, BLOCK_R)
    return tl.load(
        left_ptr + rows.to(tl.int64)[:, None] * r + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < r), other=0.0
    )


@triton.jit
def _right_chunk(right_ptr, cols, n, r, k0, BLOCK_R: tl.constexpr):
    """right[k0 : k0 + BLOCK_R, cols], zero outside the matrix."""
    ks = k0 + tl.arange(0, BLOCK_R)
    return tl.load(
        right_ptr + ks[:, None].to(tl.int64) * n + cols[None, :],
        mask=(ks[:, None] < r) & (cols[None, :] < n),
        other=0.0,
    )


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
    ONE_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    expert = tl.program_id(2).to(tl.int64)  # this program's expert: its matrices follow the previous experts'
    w_ptr += expert * m * n
    out_ptr += expert * m * n
    left_ptr += expert * m * r
    right_ptr += expert * r * n
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < m) & (cols[None, :] < n)
    offsets = rows.to(tl.int64)[:, None] * n + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ONE_CHUNK:  # the whole rank in one product, no loop for the compiler to schedule around
        left = _left_chunk(left_ptr, rows, m, r, 0, BLOCK_R)
        w = tl.load(w_ptr + offsets, mask=mask, other=0.0)
        acc = tl.dot(left, _right_chunk(right_ptr, cols, n, r, 0, BLOCK_R), acc, input_precision=PRECISION)
    else:
        w = tl.load(w_ptr + offsets, mask=mask, other=0.0)
        for k0 in range(0, r, BLOCK_R):
            left = _left_chunk(left_ptr, rows, m, r, k0, BLOCK_R)
            acc = tl.dot(left, _right_chunk(right_ptr, cols, n, r, k0, BLOCK_R), acc, input_precision=PRECISION)
    tl.store(out_ptr + offsets, (w.to(tl.float32) + scale * acc).to(out_ptr.dtype.element_ty), mask=mask)


def tile_config(weight_dtype: torch.dtype, rank: int) -> dict:
    """Tile sizes measured on an H100 with a cold L2 (4096x11008, ranks 8-128; see the package README) rather than
    autotuned: autotuning costs seconds at the first merge of every new layer shape, must keep a full-size copy of W
    to restore between timing runs of an in-place merge, and its picks ran up to 0.15 of copy bandwidth slower than
    these (bf16 W, rank 8: 0.71 against 0.85). Wider tiles pay off only where 16-bit W meets a rank above 64 (fewer
    re-reads of the factors per output); the stages matter only for ranks above MAX_BLOCK_R, whose chunks the
    compiler then pipelines."""
    wide = rank > 64 and weight_dtype != torch.float32
    return {"BLOCK_M": 64, "BLOCK_N": 128 if wide else 64, "num_warps": 4, "num_stages": 2}


TWO_PARTS_FROM_RANK = 128  # where fp32 accumulation's own error bound, (r + 2)·2^-24, reaches bf16x3's ~2^-16.4


def dot_precision(factor_dtype: torch.dtype, out_dtype: torch.dtype, rank: int) -> str:
    """How `tl.dot` multiplies the factors: exactly where they are 16-bit, else split into bf16 parts (see above)."""
    if interpreting() or factor_dtype != torch.float32:
        return "ieee"  # 16-bit factors: exact products whatever the mode; the interpreter: plain fp32
    return "bf16x3" if out_dtype == torch.bfloat16 and rank >= TWO_PARTS_FROM_RANK else "bf16x6"


def merge(weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """`out[e] = weight[e] + scale * left[e] @ right[e]` for each expert e of the 3-D tensors (a dense merge is a group
    of one) with the Triton kernel (contiguous `weight` and `out`)."""
    experts, m, n = weight.shape
    r = left.shape[2]
    factor_dtype = torch.promote_types(left.dtype, right.dtype)
    if interpreting() or factor_dtype not in (torch.bfloat16, torch.float16):
        factor_dtype = torch.float32
    precision = dot_precision(factor_dtype, out.dtype, r)
    left = left.to(factor_dtype).contiguous()
    right = right.to(factor_dtype).contiguous()
    block_r = max(16, min(MAX_BLOCK_R, triton.next_power_of_2(r)))
    # The interpreter: one small fixed tile, into fp32, rounded by torch (the interpreter's bf16 cast truncates).
    config = {"BLOCK_M": 32, "BLOCK_N": 32} if interpreting() else tile_config(weight.dtype, r)
    target = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if interpreting() else out
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]), experts)
    _merge_kernel[grid](
        weight, target, left, right, m, n, r, scale, BLOCK_R=block_r, ONE_CHUNK=r <= block_r, PRECISION=precision,
        **config,
    )  # fmt: skip
    if target is not out:
        out.copy_(target)  # the one rounding

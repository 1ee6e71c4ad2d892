"""Independent references for the merge: a float64 computation and ulp arithmetic."""

import torch

MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def _product(lora_A, lora_B, fan_in_fan_out, absolute=False):
    a, b = lora_A.double(), lora_B.double()
    if absolute:
        a, b = a.abs(), b.abs()
    delta = b @ a
    return delta.T if fan_in_fan_out else delta


def merged_float64(weight, lora_A, lora_B, scale, fan_in_fan_out=False):
    return weight.double() + scale * _product(lora_A, lora_B, fan_in_fan_out)


def magnitude(weight, lora_A, lora_B, scale, fan_in_fan_out=False):
    """|W| + |s|·|B|@|A|: the size of the terms summed into each element."""
    return weight.double().abs() + abs(scale) * _product(lora_A, lora_B, fan_in_fan_out, absolute=True)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype`'s numbers at |x| (normal range; the subnormal spacing below it)."""
    exponent = torch.floor(torch.log2(x.abs().clamp(min=torch.finfo(dtype).tiny)))
    return torch.exp2(exponent - (MANTISSA_BITS[dtype] - 1))


def assert_merged_close(got, weight, lora_A, lora_B, scale, fan_in_fan_out=False):
    """bf16/fp16: within 1 ulp of the correctly rounded value — except where the terms cancel (|W + s·BA| far below
    |W| + |s|·|B||A|): there the fp32 accumulation the contract specifies is off by up to (r + 2) fp32 epsilons of
    the terms, more than an ulp of the tiny result, for every fp32-accumulating implementation (torch's included).
    fp32: within 1e-6 relative to the terms' magnitude (elementwise relative error is meaningless where they cancel).
    """
    got, weight, lora_A, lora_B = (t.cpu() for t in (got, weight, lora_A, lora_B))  # the reference runs on the CPU
    exact = merged_float64(weight, lora_A, lora_B, scale, fan_in_fan_out)
    size = magnitude(weight, lora_A, lora_B, scale, fan_in_fan_out)
    error = (got.double() - exact).abs()
    if got.dtype == torch.float32:
        assert (error <= 1e-6 * size).all(), f"max relative error {(error / size).max().item()}"
        return
    rounded = exact.to(got.dtype).double()
    within_ulp = (got.double() - rounded).abs() <= ulp(rounded, got.dtype)
    accumulation = (lora_A.shape[0] + 2) * 2.0**-24 * size
    within_accumulation = error <= 0.5 * ulp(rounded, got.dtype) + accumulation
    cancelling = exact.abs() < 2.0**-8 * size  # the result is 256x smaller than the terms
    assert (within_ulp | (cancelling & within_accumulation)).all(), (
        f"{int((~within_ulp).sum())} elements more than 1 ulp off, "
        f"{int((~within_ulp & ~cancelling).sum())} of them without cancellation"
    )

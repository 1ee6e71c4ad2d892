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
    """bf16: within 1 ulp of the correctly rounded value. fp16: the same, except where cancellation makes the fp32
    accumulation error (which the contract allows: (r + 2) fp32 epsilons of the terms) larger than an ulp of the tiny
    result. fp32: within 1e-6 relative to the terms' magnitude (elementwise relative error is meaningless where the
    terms cancel)."""
    exact = merged_float64(weight, lora_A, lora_B, scale, fan_in_fan_out)
    size = magnitude(weight, lora_A, lora_B, scale, fan_in_fan_out)
    error = (got.double() - exact).abs()
    if got.dtype == torch.float32:
        assert (error <= 1e-6 * size).all(), f"max relative error {(error / size).max().item()}"
        return
    rounded = exact.to(got.dtype).double()
    off = (got.double() - rounded).abs()
    within_ulp = off <= ulp(rounded, got.dtype)
    if got.dtype == torch.bfloat16:
        assert within_ulp.all(), f"{int((~within_ulp).sum())} elements more than 1 ulp off, max {off.max().item()}"
        return
    accumulation = (lora_A.shape[0] + 2) * 2.0**-24 * size
    assert (within_ulp | (error <= 0.5 * ulp(rounded, got.dtype) + accumulation)).all()

"""Every backend against a float64 reference: one rounding, fp32 accumulation, nothing else touched."""

import pytest
import torch
from merge_reference import assert_merged_close, merged_float64

from lorarl.lora_merge import _cpp_backend, available_backends, merge_lora, merge_lora_

BACKENDS = ["torch", "cpp", "triton"]
SHAPES = [(1, 1), (5, 70), (64, 64), (97, 200), (130, 257)]  # edges of every tile size, and whole tiles


def factors(shape, rank, fan_in_fan_out=False, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows, cols = shape
    fan_in, fan_out = (rows, cols) if fan_in_fan_out else (cols, rows)
    lora_A = torch.randn(rank, fan_in, generator=generator).to(dtype)
    lora_B = torch.randn(fan_out, rank, generator=generator).to(dtype)
    return lora_A, lora_B


def test_every_backend_is_available_here():
    assert available_backends("cpu") == ["torch", "cpp", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rank", [1, 8, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_reference(backend, dtype, rank, shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    lora_A, lora_B = factors(shape, rank)
    before = weight.clone()
    got = merge_lora(weight, lora_A, lora_B, 0.37, backend=backend)
    assert got.dtype == dtype
    assert got.shape == weight.shape
    assert torch.equal(weight, before)  # out of place: the base is untouched
    assert_merged_close(got, weight, lora_A, lora_B, 0.37)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
def test_fan_in_fan_out_and_factor_dtypes(backend, factor_dtype):
    shape = (96, 72)  # Conv1D: weight [in, out]
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    lora_A, lora_B = factors(shape, 8, fan_in_fan_out=True, dtype=factor_dtype)
    got = merge_lora(weight, lora_A, lora_B, -1.5, fan_in_fan_out=True, backend=backend)
    assert_merged_close(got, weight, lora_A, lora_B, -1.5, fan_in_fan_out=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_in_another_dtype_is_rounded_once_from_the_exact_value(backend):
    weight = torch.randn(70, 90, generator=torch.Generator().manual_seed(3))  # an fp32 master weight into bf16
    lora_A, lora_B = factors(weight.shape, 16)
    out = torch.empty(70, 90, dtype=torch.bfloat16)
    assert merge_lora(weight, lora_A, lora_B, 0.5, out=out, backend=backend) is out
    assert_merged_close(out, weight, lora_A, lora_B, 0.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place(backend):
    weight = torch.randn(65, 130, generator=torch.Generator().manual_seed(4)).bfloat16()
    original = weight.clone()
    lora_A, lora_B = factors(weight.shape, 8)
    assert merge_lora_(weight, lora_A, lora_B, 2.0, backend=backend) is weight
    assert_merged_close(weight, original, lora_A, lora_B, 2.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs_and_out_are_handled_correctly(backend):
    generator = torch.Generator().manual_seed(5)
    storage = torch.randn(80, 140, generator=generator).bfloat16()
    weight = storage[:, ::2]  # strided view [80, 70]
    lora_A = torch.randn(70, 8, generator=generator).t()  # transposed view [8, 70]
    lora_B = torch.randn(8, 80, generator=generator).t()
    out_storage = torch.zeros(80, 140, dtype=torch.bfloat16)
    out = out_storage[:, 1::2]
    merge_lora(weight, lora_A, lora_B, 0.25, out=out, backend=backend)
    assert_merged_close(out, weight, lora_A, lora_B, 0.25)
    assert (out_storage[:, ::2] == 0).all()  # nothing written outside the view
    weight_copy = weight.clone()
    merge_lora_(weight, lora_A, lora_B, 0.25, backend=backend)  # in place into a strided view
    assert_merged_close(weight, weight_copy, lora_A, lora_B, 0.25)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_zero_and_zero_scale_copy_the_weight(backend):
    weight = torch.randn(9, 33, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert torch.equal(merge_lora(weight, torch.zeros(0, 33), torch.zeros(9, 0), 1.0, backend=backend), weight)
    lora_A, lora_B = factors(weight.shape, 4)
    assert torch.equal(merge_lora(weight, lora_A, lora_B, 0.0, backend=backend), weight)


@pytest.mark.parametrize("shape", [(8, 24), (12, 128)])  # scalar edge columns; whole vector micro-tiles
def test_cpp_op_keeps_special_values(shape):
    values = torch.tensor([1e-39, -3e-39, float("nan"), float("inf"), -float("inf"), 3.0e38, -0.0, 0.0])
    weight = values.repeat(shape[0] * shape[1] // 8).view(shape).bfloat16()
    got = merge_lora(weight, torch.zeros(1, shape[1]), torch.zeros(shape[0], 1), 1.0, backend="cpp")
    assert torch.equal(got.isnan(), weight.isnan())
    assert torch.equal(got[~got.isnan()], weight[~weight.isnan()])  # denormals, infinities and -0 survive exactly


def test_cpp_op_rounds_denormal_results_exactly():
    """W normal, W + s·BA denormal: the AVX512-BF16 rounding would flush it to zero; the op must not."""
    weight = torch.full((12, 128), 2.0**-120).bfloat16()
    lora_A = torch.ones(1, 128)
    lora_B = torch.full((12, 1), -(2.0**-120 - 2.0**-130))
    lora_B[::2] = 1.0  # half the rows stay normal, so pairs with and without denormals meet in one micro-tile
    got = merge_lora(weight, lora_A, lora_B, 1.0, backend="cpp")
    expected = merged_float64(weight, lora_A, lora_B, 1.0).to(torch.bfloat16)
    assert torch.equal(got, expected)
    assert (got[1::2] == 2.0**-130).all()


def test_cpp_op_with_rank_zero_copies_the_weight():
    weight = torch.randn(9, 33, generator=torch.Generator().manual_seed(8))
    out = torch.empty(9, 33, dtype=torch.bfloat16)
    _cpp_backend.merge(weight, torch.zeros(9, 0), torch.zeros(0, 33), 1.0, out)  # the op itself, loaded first
    assert torch.equal(out, weight.bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpp_op_large_outputs_written_around_the_caches(dtype):
    """Outputs of 4 MiB and more are written with non-temporal stores: same values, every element written."""
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(1030, 2048 if dtype == torch.bfloat16 else 1024, generator=generator).to(dtype)
    lora_A, lora_B = factors(weight.shape, 8)
    out = torch.full_like(weight, float("nan"))
    assert out.nbytes >= 4 << 20
    merge_lora(weight, lora_A, lora_B, 0.75, out=out, backend="cpp")
    assert_merged_close(out, weight, lora_A, lora_B, 0.75)


def test_backends_agree_bitwise_on_bf16_where_rounding_is_unambiguous():
    """Same fp32 sum, same single rounding: the backends differ only where fp32 summation order matters."""
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(7)).bfloat16()
    lora_A, lora_B = factors(weight.shape, 8)
    results = [merge_lora(weight, lora_A, lora_B, 0.5, backend=b) for b in BACKENDS]
    for other in results[1:]:
        assert (other != results[0]).float().mean() < 0.01


@pytest.mark.parametrize("backend", BACKENDS)
def test_within_one_ulp_over_many_random_layers(backend):
    """Many seeds: the 1-ulp rule holds everywhere but at cancellations (where fp32 accumulation is the limit)."""
    for seed in range(40):
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(96, 72, generator=generator).bfloat16()
        lora_A = torch.randn(8, 96, generator=generator)
        lora_B = torch.randn(72, 8, generator=generator)
        got = merge_lora(weight, lora_A, lora_B, -1.5, fan_in_fan_out=True, backend=backend)
        assert_merged_close(got, weight, lora_A, lora_B, -1.5, fan_in_fan_out=True)

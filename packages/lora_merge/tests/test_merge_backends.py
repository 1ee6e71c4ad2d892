"""Every backend against a float64 reference: one rounding, fp32 accumulation, nothing else touched."""

import os

import pytest
import torch
from merge_reference import assert_merged_close, merged_float64

from lorarl.lora_merge import _cpp_backend, available_backends, merge_lora, merge_lora_

BACKENDS = ["torch", "cpp", "triton"]
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # Triton on CPU tensors (set in conftest without a GPU)
ON_DEVICES = [  # (backend, device): every backend on CPU (Triton under its interpreter) and, given a GPU, on CUDA
    pytest.param(backend, device, id=f"{backend}-{device}")
    for device in DEVICES
    for backend in BACKENDS
    if backend != "triton" or device == "cuda" or INTERPRETING
]
SHAPES = [(1, 1), (5, 70), (64, 64), (97, 200), (130, 257)]  # edges of every tile size, and whole tiles


def factors(shape, rank, fan_in_fan_out=False, dtype=torch.float32, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    rows, cols = shape
    fan_in, fan_out = (rows, cols) if fan_in_fan_out else (cols, rows)
    lora_A = torch.randn(rank, fan_in, generator=generator).to(dtype).to(device)
    lora_B = torch.randn(fan_out, rank, generator=generator).to(dtype).to(device)
    return lora_A, lora_B


def skip_where_bf16_denormals_are_misread(backend, device):
    if backend == "triton" and device == "cpu":
        pytest.skip("Triton's interpreter loads bf16 denormals wrongly (1e-39 as 4.4e-39); GPUs run the real kernel")


def test_every_backend_is_available_here():
    assert available_backends("cpu") == (["torch", "cpp", "triton"] if INTERPRETING else ["torch", "cpp"])
    if torch.cuda.is_available():
        assert available_backends("cuda") == ["torch", "cpp", "triton"]


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rank", [1, 8, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_reference(backend, device, dtype, rank, shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    lora_A, lora_B = factors(shape, rank, device=device)
    before = weight.clone()
    got = merge_lora(weight, lora_A, lora_B, 0.37, backend=backend)
    assert got.dtype == dtype
    assert got.shape == weight.shape
    assert torch.equal(weight, before)  # out of place: the base is untouched
    assert_merged_close(got, weight, lora_A, lora_B, 0.37)


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ranks_beyond_one_product(backend, device, dtype):
    """Rank 300: more than one `tl.dot` (Triton walks it in chunks of 128, the last one partial)."""
    weight = torch.randn(70, 150, generator=torch.Generator().manual_seed(12)).to(dtype).to(device)
    lora_A, lora_B = factors(weight.shape, 300, seed=13, device=device)
    got = merge_lora(weight, lora_A, lora_B, 0.05, backend=backend)
    assert_merged_close(got, weight, lora_A, lora_B, 0.05)


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
def test_fan_in_fan_out_and_factor_dtypes(backend, device, factor_dtype):
    shape = (96, 72)  # Conv1D: weight [in, out]
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(2)).bfloat16().to(device)
    lora_A, lora_B = factors(shape, 8, fan_in_fan_out=True, dtype=factor_dtype, device=device)
    got = merge_lora(weight, lora_A, lora_B, -1.5, fan_in_fan_out=True, backend=backend)
    assert_merged_close(got, weight, lora_A, lora_B, -1.5, fan_in_fan_out=True)


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rank", [7, 16, 64])  # even ranks: the C++ op multiplies bf16 factors in pairs (AVX512-BF16)
def test_bf16_factors_match_float64_reference(backend, device, dtype, rank):
    shape = (130, 257)  # whole micro-tiles, a partial one, and edge columns
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(14)).to(dtype).to(device)
    lora_A, lora_B = factors(shape, rank, dtype=torch.bfloat16, seed=15, device=device)
    got = merge_lora(weight, lora_A, lora_B, -0.3, backend=backend)
    assert_merged_close(got, weight, lora_A, lora_B, -0.3)


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
def test_out_in_another_dtype_is_rounded_once_from_the_exact_value(backend, device):
    weight = torch.randn(70, 90, generator=torch.Generator().manual_seed(3)).to(device)  # fp32 master weight → bf16
    lora_A, lora_B = factors(weight.shape, 16, device=device)
    out = torch.empty(70, 90, dtype=torch.bfloat16, device=device)
    assert merge_lora(weight, lora_A, lora_B, 0.5, out=out, backend=backend) is out
    assert_merged_close(out, weight, lora_A, lora_B, 0.5)


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
def test_in_place(backend, device):
    weight = torch.randn(65, 130, generator=torch.Generator().manual_seed(4)).bfloat16().to(device)
    original = weight.clone()
    lora_A, lora_B = factors(weight.shape, 8, device=device)
    assert merge_lora_(weight, lora_A, lora_B, 2.0, backend=backend) is weight
    assert_merged_close(weight, original, lora_A, lora_B, 2.0)


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
def test_non_contiguous_inputs_and_out_are_handled_correctly(backend, device):
    generator = torch.Generator().manual_seed(5)
    storage = torch.randn(80, 140, generator=generator).bfloat16().to(device)
    weight = storage[:, ::2]  # strided view [80, 70]
    lora_A = torch.randn(70, 8, generator=generator).to(device).t()  # transposed view [8, 70]
    lora_B = torch.randn(8, 80, generator=generator).to(device).t()
    out_storage = torch.zeros(80, 140, dtype=torch.bfloat16, device=device)
    out = out_storage[:, 1::2]
    merge_lora(weight, lora_A, lora_B, 0.25, out=out, backend=backend)
    assert_merged_close(out, weight, lora_A, lora_B, 0.25)
    assert (out_storage[:, ::2] == 0).all()  # nothing written outside the view
    weight_copy = weight.clone()
    merge_lora_(weight, lora_A, lora_B, 0.25, backend=backend)  # in place into a strided view
    assert_merged_close(weight, weight_copy, lora_A, lora_B, 0.25)


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
def test_rank_zero_and_zero_scale_copy_the_weight(backend, device):
    weight = torch.randn(9, 33, generator=torch.Generator().manual_seed(6)).bfloat16().to(device)
    empty_A, empty_B = torch.zeros(0, 33, device=device), torch.zeros(9, 0, device=device)
    assert torch.equal(merge_lora(weight, empty_A, empty_B, 1.0, backend=backend), weight)
    lora_A, lora_B = factors(weight.shape, 4, device=device)
    assert torch.equal(merge_lora(weight, lora_A, lora_B, 0.0, backend=backend), weight)


SPECIAL_VALUES = {  # per dtype: two denormals, NaN, infinities, the largest finite value's order, zeros
    torch.bfloat16: [1e-39, -3e-39, float("nan"), float("inf"), -float("inf"), 3.0e38, -0.0, 0.0],
    torch.float16: [1e-7, -3e-6, float("nan"), float("inf"), -float("inf"), 65504.0, -0.0, 0.0],
}


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
@pytest.mark.parametrize("dtype", list(SPECIAL_VALUES))
@pytest.mark.parametrize("shape", [(8, 24), (12, 128)])  # C++ op: scalar edge columns; whole vector micro-tiles
def test_special_values_survive(backend, device, dtype, shape):
    if dtype == torch.bfloat16:
        skip_where_bf16_denormals_are_misread(backend, device)
    values = torch.tensor(SPECIAL_VALUES[dtype])
    weight = values.repeat(shape[0] * shape[1] // 8).view(shape).to(dtype).to(device)
    lora_A, lora_B = torch.zeros(1, shape[1], device=device), torch.zeros(shape[0], 1, device=device)
    got = merge_lora(weight, lora_A, lora_B, 1.0, backend=backend)
    assert torch.equal(got.isnan(), weight.isnan())
    assert torch.equal(got[~got.isnan()], weight[~weight.isnan()])  # denormals, infinities and -0 survive exactly


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
def test_float16_denormal_and_overflowing_results_are_rounded_exactly(backend, device):
    """W normal, W + s·BA an fp16 denormal in odd rows (12 x 128: whole C++ micro-tiles), or past 65504 in row 0."""
    weight = torch.full((12, 128), 2.0**-14).half()
    weight[0] = 65504.0
    lora_A = torch.ones(1, 128)
    lora_B = torch.full((12, 1), -(2.0**-14 - 2.0**-20))
    lora_B[::2] = 1.0
    lora_B[0] = 32.0  # 65536: past the halfway point to the next power of two, so it rounds to infinity
    got = merge_lora(weight.to(device), lora_A.to(device), lora_B.to(device), 1.0, backend=backend).cpu()
    expected = merged_float64(weight, lora_A, lora_B, 1.0).to(torch.float16)
    assert torch.equal(got, expected)
    assert (got[1::2] == 2.0**-20).all()
    assert got[0].isinf().all()


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
def test_denormal_results_are_rounded_exactly(backend, device):
    """W normal, W + s·BA denormal: the AVX512-BF16 rounding (C++ op) or a GPU's flush-to-zero would give 0."""
    skip_where_bf16_denormals_are_misread(backend, device)
    weight = torch.full((12, 128), 2.0**-120).bfloat16()
    lora_A = torch.ones(1, 128)
    lora_B = torch.full((12, 1), -(2.0**-120 - 2.0**-130))
    lora_B[::2] = 1.0  # half the rows stay normal, so pairs with and without denormals meet in one micro-tile
    got = merge_lora(weight.to(device), lora_A.to(device), lora_B.to(device), 1.0, backend=backend).cpu()
    expected = merged_float64(weight, lora_A, lora_B, 1.0).to(torch.bfloat16)
    assert torch.equal(got, expected)
    assert (got[1::2] == 2.0**-130).all()


def test_cpp_op_with_rank_zero_copies_the_weight():
    weight = torch.randn(9, 33, generator=torch.Generator().manual_seed(8))
    out = torch.empty(9, 33, dtype=torch.bfloat16)
    _cpp_backend.merge(weight, torch.zeros(9, 0), torch.zeros(0, 33), 1.0, out)  # the op itself, loaded first
    assert torch.equal(out, weight.bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpp_op_large_outputs_written_around_the_caches(dtype):
    """Outputs of 4 MiB and more are written with non-temporal stores: same values, every element written."""
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(1030, 1024 if dtype == torch.float32 else 2048, generator=generator).to(dtype)
    lora_A, lora_B = factors(weight.shape, 8)
    out = torch.full_like(weight, float("nan"))
    assert out.nbytes >= 4 << 20
    merge_lora(weight, lora_A, lora_B, 0.75, out=out, backend="cpp")
    assert_merged_close(out, weight, lora_A, lora_B, 0.75)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpp_op_special_values_survive_in_large_outputs(weight_dtype):
    """Special values in an output written around the caches (on AVX2 through a staging tile in L1), fp32 weights
    rounded to bf16 among them: NaNs of any payload stay NaN (0x7fffffff would round to -0 on the bits alone), the
    rest round exactly."""
    out_dtype = torch.bfloat16 if weight_dtype == torch.float32 else weight_dtype
    values = torch.tensor(SPECIAL_VALUES[out_dtype])
    if weight_dtype == torch.float32:
        values[:2] = torch.tensor([0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32)  # NaNs, low bits set
    weight = values.repeat(1024 * 2048 // 8).view(1024, 2048).to(weight_dtype)
    weight[::7] = torch.randn(2048).to(weight_dtype)  # tiles without special values between those with them
    out = torch.zeros(weight.shape, dtype=out_dtype)
    assert out.nbytes >= 4 << 20
    merge_lora(weight, torch.zeros(2, 2048), torch.zeros(1024, 2), 1.0, out=out, backend="cpp")
    assert torch.equal(out.isnan(), weight.isnan())
    assert torch.equal(out[~out.isnan()], weight[~weight.isnan()].to(out_dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpp_op_large_merges_in_place(dtype):
    """In place, outputs of 4 MiB and more are written by regular stores (their lines were just read into the
    caches): every element merged once, from the weight as it was."""
    generator = torch.Generator().manual_seed(10)
    weight = torch.randn(1030, 1024 if dtype == torch.float32 else 2048, generator=generator).to(dtype)
    lora_A, lora_B = factors(weight.shape, 8, seed=11)
    merged = weight.clone()
    assert merged.nbytes >= 4 << 20
    merge_lora_(merged, lora_A, lora_B, 0.75, backend="cpp")
    assert_merged_close(merged, weight, lora_A, lora_B, 0.75)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpp_op_sweeps_wide_layers_in_column_chunks(dtype):
    """Rank 512 on 2085 columns: the packed factor (4 MiB) outgrows the op's column chunk (at most 512 KiB), so
    each thread sweeps its rows chunk after chunk, then the 37 columns past the last panel; the 1030 rows end in a
    partial block, and out (over 4 MiB) is written around the caches."""
    generator = torch.Generator().manual_seed(14)
    weight = torch.randn(1030, 2085, generator=generator).to(dtype)
    lora_A, lora_B = factors(weight.shape, 512, seed=15)
    lora_A /= 512**0.5
    out = torch.full_like(weight, float("nan"))
    assert out.nbytes >= 4 << 20
    merge_lora(weight, lora_A, lora_B, 0.5, out=out, backend="cpp")
    assert_merged_close(out, weight, lora_A, lora_B, 0.5)


def test_backends_agree_bitwise_on_bf16_where_rounding_is_unambiguous():
    """Same fp32 sum, same single rounding: the backends differ only where fp32 summation order matters."""
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(7)).bfloat16()
    lora_A, lora_B = factors(weight.shape, 8)
    results = [
        merge_lora(weight.to(d), lora_A.to(d), lora_B.to(d), 0.5, backend=b).cpu()
        for b, d in (p.values for p in ON_DEVICES)
    ]
    for other in results[1:]:
        assert (other != results[0]).float().mean() < 0.01


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
def test_within_one_ulp_over_many_random_layers(backend, device):
    """Many seeds: the 1-ulp rule holds everywhere but at cancellations (where fp32 accumulation is the limit)."""
    for seed in range(40):
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(96, 72, generator=generator).bfloat16().to(device)
        lora_A = torch.randn(8, 96, generator=generator).to(device)
        lora_B = torch.randn(72, 8, generator=generator).to(device)
        got = merge_lora(weight, lora_A, lora_B, -1.5, fan_in_fan_out=True, backend=backend)
        assert_merged_close(got, weight, lora_A, lora_B, -1.5, fan_in_fan_out=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: its tile sizes run there only")
@pytest.mark.parametrize("backend", ["triton", "cpp"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rank", [16, 128, 300])  # one product, the widest one, chunks
@pytest.mark.parametrize("shape", [(1000, 1500), (4096, 700)])
def test_large_layers_on_gpu(backend, dtype, rank, shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(10)).to(dtype).cuda()
    lora_A, lora_B = factors(shape, rank, seed=11, device="cuda")
    lora_A /= rank**0.5  # products of the size real adapters have, whatever the rank
    out = torch.full_like(weight, float("nan"))
    merge_lora(weight, lora_A, lora_B, 0.5, out=out, backend=backend)
    assert_merged_close(out, weight, lora_A, lora_B, 0.5)


@pytest.mark.parametrize(("triton", "cpp_builds", "expected"), [(True, True, "triton"), (False, True, "cpp"),
                                                                 (False, False, "torch")])  # fmt: skip
def test_auto_on_cuda_prefers_triton_then_the_cuda_op(monkeypatch, triton, cpp_builds, expected):
    """Which kernel `auto` picks for CUDA tensors (nothing runs: this machine may have no GPU)."""
    from lorarl.lora_merge import _torch_backend, merge

    monkeypatch.setattr(merge, "_triton_installed", lambda: triton)
    monkeypatch.setattr(merge, "_cpp_op_builds", lambda with_cuda: with_cuda and cpp_builds)
    kernel = merge._kernel("auto", torch.device("cuda"))
    if expected == "triton":
        pytest.importorskip("triton")
        from lorarl.lora_merge import _triton_backend

        assert kernel is _triton_backend.merge
    else:
        assert kernel is {"cpp": _cpp_backend.merge, "torch": _torch_backend.merge}[expected]

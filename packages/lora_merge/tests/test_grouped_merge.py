"""The grouped merge (every expert of a mixture in one call) against a float64 reference per expert, and bit for bit
against the dense merge of each expert on its own (the same kernel, one call instead of E)."""

import pytest
import torch
from merge_reference import assert_merged_close
from test_merge_backends import ON_DEVICES

from lorarl.lora_merge import merge_lora, merge_lora_grouped

SHAPES = [(1, 5, 70), (3, 64, 64), (4, 97, 200)]  # (experts, out, in): tile edges and whole tiles


def expert_factors(experts, rows, cols, rank, *, transposed=False, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    fan_in, fan_out = (rows, cols) if transposed else (cols, rows)
    lora_A = torch.randn(experts, rank, fan_in, generator=generator).to(dtype)
    lora_B = torch.randn(experts, fan_out, rank, generator=generator).to(dtype)
    return lora_A, lora_B


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_each_expert_as_its_own_merge(backend, device, dtype, transposed, shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    lora_A, lora_B = (t.to(device) for t in expert_factors(*shape, 8, transposed=transposed))
    before = weight.clone()
    got = merge_lora_grouped(weight, lora_A, lora_B, 0.37, transposed=transposed, backend=backend)
    assert got.shape == weight.shape
    assert got.dtype == dtype
    assert torch.equal(weight, before)  # out of place
    for e in range(shape[0]):
        assert_merged_close(got[e], weight[e], lora_A[e], lora_B[e], 0.37, fan_in_fan_out=transposed)
        alone = merge_lora(weight[e], lora_A[e], lora_B[e], 0.37, fan_in_fan_out=transposed, backend=backend)
        assert torch.equal(got[e], alone), f"expert {e} differs from its own merge"


@pytest.mark.parametrize(("backend", "device"), ON_DEVICES)
@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])  # bf16: the C++ op's pairs of ranks
def test_peft_flat_layout_read_in_place(backend, device, factor_dtype):
    """peft keeps an expert adapter flat: `lora_A [E·r, in]`, `lora_B [out, r·E]` with expert e's rank k in column
    k·E + e. Its views (`lora_B.view(out, r, E).permute(2, 0, 1)`, strided) merge as the copies they stand for."""
    experts, rows, cols, rank = 4, 48, 40, 6
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(experts, rows, cols, generator=generator).to(torch.bfloat16).to(device)
    flat_A = torch.randn(experts * rank, cols, generator=generator).to(factor_dtype).to(device)
    flat_B = torch.randn(rows, rank * experts, generator=generator).to(factor_dtype).to(device)
    lora_A = flat_A.view(experts, rank, cols)
    lora_B = flat_B.view(rows, rank, experts).permute(2, 0, 1)
    assert not lora_B.is_contiguous()
    got = merge_lora_grouped(weight, lora_A, lora_B, 2.0, backend=backend)
    expected = merge_lora_grouped(weight, lora_A.contiguous(), lora_B.contiguous(), 2.0, backend=backend)
    assert torch.equal(got, expected)
    for e in range(experts):  # column k·E + e of the flat B is expert e's rank k
        B_e = torch.stack([flat_B[:, k * experts + e] for k in range(rank)], dim=1)
        assert_merged_close(got[e], weight[e], flat_A[e * rank : (e + 1) * rank], B_e, 2.0)


def test_large_group_streams_bf16_pairs():
    """A group large enough for the C++ op's non-temporal stores, with bf16 factors of an even rank (multiplied in
    pairs where the CPU has AVX512-BF16): still each expert's own merge, bit for bit."""
    experts, rows, cols = 6, 512, 1024  # 6 MiB of bf16 output: streamed as a group, though no expert alone would be
    weight = torch.randn(experts, rows, cols, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    lora_A, lora_B = expert_factors(experts, rows, cols, 16, dtype=torch.bfloat16, seed=4)
    got = merge_lora_grouped(weight, lora_A, lora_B, 0.5, backend="cpp", out=torch.empty(weight.shape))
    assert got.dtype == torch.float32
    got16 = merge_lora_grouped(weight, lora_A, lora_B, 0.5, backend="cpp")
    for e in range(experts):
        assert torch.equal(got16[e], merge_lora(weight[e], lora_A[e], lora_B[e], 0.5, backend="cpp"))
        assert_merged_close(got16[e], weight[e], lora_A[e], lora_B[e], 0.5)
        assert_merged_close(got[e], weight[e], lora_A[e], lora_B[e], 0.5)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({"weight": torch.zeros(8, 6)}, r"weight must be 3-D \(experts, rows, columns\), got shape \(8, 6\)"),
        ({"lora_A": torch.zeros(3, 2, 6)}, r"lora_A must have shape \[E, r, in\] = \[4, r, 6\]"),
        ({"lora_B": torch.zeros(4, 8, 3)}, r"lora_B must have shape \[E, out, r\] = \[4, 8, 2\] \(rank from lora_A"),
        ({"transposed": True}, r"lora_A must have shape \[E, r, in\] = \[4, r, 8\] for weight \(4, 8, 6\) \(transp"),
    ],
    ids=["2-D weight", "experts differ", "rank differs", "transposed"],
)
def test_bad_shapes_in_one_line(call, message):
    args = {"weight": torch.zeros(4, 8, 6), "lora_A": torch.zeros(4, 2, 6), "lora_B": torch.zeros(4, 8, 2)}
    args.update(call)
    with pytest.raises(ValueError, match=message):
        merge_lora_grouped(args.pop("weight"), args.pop("lora_A"), args.pop("lora_B"), 1.0, **args)

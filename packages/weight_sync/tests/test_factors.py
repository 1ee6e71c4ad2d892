"""The factor set's format and the engine's `FactorMerger`: the set read back is what was sent; the merge from the
kept base equals `lora_merge.merge_lora` of the trainer's base bit for bit, also where the base is kept narrowed to
the engine's dtype; what does not fit is refused, naming it, before anything is merged."""

import pytest
import torch

from lorarl.lora_merge import merge_lora
from lorarl.weight_sync.factors import FactorMerger, Factors, factor_set, narrowed_base, read_factor_set


def layer(out_features: int, in_features: int, rank: int, seed: int, *, bf16_exact: bool) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    if bf16_exact:
        weight = weight.to(torch.bfloat16).float()
    factors = Factors(torch.randn(rank, in_features, generator=generator),
                      torch.randn(out_features, rank, generator=generator) * 0.1, 0.5 + seed, False)  # fmt: skip
    return weight, factors


def test_a_factor_set_reads_back_as_sent():
    weight, factors = layer(6, 5, 2, 0, bf16_exact=False)
    sibling = torch.randn(3, 5)
    transposed = Factors(factors.lora_A.T.contiguous().T, factors.lora_B, 0.1 + 0.2, True)  # an inexact float
    base_weights = {"a.q.weight": weight, "a.k.weight": sibling}
    tensors = factor_set({"a.q.weight": factors, "a.c.weight": transposed}, base_weights)
    read, base = read_factor_set(tensors)
    assert read["a.c.weight"].scale == 0.1 + 0.2  # exactly
    assert read["a.c.weight"].fan_in_fan_out
    assert not read["a.q.weight"].fan_in_fan_out
    assert read["a.q.weight"].lora_A is factors.lora_A
    assert all(base[name] is tensor for name, tensor in base_weights.items())
    assert base.keys() == base_weights.keys()
    with pytest.raises(ValueError, match=r"lacks \['a.q.weight.lora_B'\]"):
        read_factor_set({k: v for k, v in tensors.items() if k != "a.q.weight.lora_B"})
    with pytest.raises(ValueError, match=r"without a scale: \['a.q.weight.lora_A'"):
        read_factor_set({k: v for k, v in tensors.items() if k != "a.q.weight.lora_scale"})


@pytest.mark.parametrize("engine_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bf16_exact", [True, False])
def test_merged_from_the_kept_base_equals_the_trainers_merge_bit_for_bit(engine_dtype, bf16_exact):
    weights, factors = zip(*(layer(48, 40, 4, seed, bf16_exact=bf16_exact) for seed in range(3)), strict=True)
    names = [f"l{i}.weight" for i in range(3)]
    merger = FactorMerger(engine_dtype)
    merger.store(dict(zip(names[:2], weights[:2], strict=True)))
    assert list(merger.base) == names[:2]
    narrowed = bf16_exact and engine_dtype == torch.bfloat16  # held exactly: kept in half the memory
    assert {t.dtype for t in merger.base.values()} == {torch.bfloat16 if narrowed else torch.float32}
    merged = dict(merger.merged(dict(zip(names[:2], factors[:2], strict=True))))
    for name, weight, f in zip(names[:2], weights[:2], factors[:2], strict=True):
        expected = merge_lora(weight, f.lora_A, f.lora_B, f.scale, out=torch.empty_like(weight, dtype=engine_dtype))
        assert torch.equal(merged[name], expected), name
    assert torch.equal(dict(merger.merged({}))["l0.weight"], weights[0].to(engine_dtype))  # unadapted: W0 itself


def test_what_does_not_fit_is_refused_before_any_merge():
    weight, factors = layer(8, 6, 2, 0, bf16_exact=False)
    merger = FactorMerger(torch.float32)
    with pytest.raises(ValueError, match=r"no base weight for 'x\.weight'"):
        list(merger.merged({"x.weight": factors}))
    merger.store({"x.weight": weight, "y.weight": weight.clone()})
    outputs = {"x.weight": torch.zeros(8, 6), "y.weight": torch.zeros(8, 6)}
    wrong = Factors(factors.lora_A, factors.lora_B[:, :1], 1.0, False)
    with pytest.raises(ValueError, match=r"y.weight: factors \(2, 6\) and \(8, 1\) do not fit"):
        list(merger.merged({"x.weight": factors, "y.weight": wrong}, outputs=outputs))
    assert not outputs["x.weight"].any()  # nothing merged, not even the layer that fits


def test_a_sender_narrows_only_the_base_weights_and_only_where_exact():
    exact, inexact = torch.randn(4, 4).to(torch.bfloat16).float(), torch.randn(4, 4) / 3
    _, factors = layer(4, 4, 2, 0, bf16_exact=True)
    sent = narrowed_base(factor_set({"a.weight": factors}, {"a.weight": exact, "b.weight": inexact}), torch.bfloat16)
    assert sent["a.weight"].dtype == torch.bfloat16
    assert torch.equal(sent["a.weight"].float(), exact)
    assert sent["b.weight"] is inexact  # not exact in bf16: as it is
    assert sent["a.weight.lora_A"] is factors.lora_A  # factors travel as trained

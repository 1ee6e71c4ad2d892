"""`lora_factors` + `merge_factors`: the base weights and the factors alone rebuild `iter_merged_weights`' merged
model bit for bit (the factor sync's premise), on real peft models."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from lorarl.lora_merge import iter_merged_weights, lora_factors, merge_factors


def lora(model, **config):
    return get_peft_model(model, LoraConfig(init_lora_weights=False, **config))


def rebuilt(model, dtype, backend="auto"):
    """The merged state dict from the base weights (adapters off) and the factors, merged into `dtype`."""
    factors = lora_factors(model)
    with model.disable_adapter():
        base = dict(iter_merged_weights(model))
    return {name: merge_factors(base[name], factors[name], out=torch.empty_like(base[name], dtype=dtype),
                                backend=backend) if name in factors else base[name].to(dtype)
            for name in base}  # fmt: skip


def assert_bit_identical(model, dtype, backend="auto"):
    merged = dict(iter_merged_weights(model, dtype=dtype, backend=backend))
    ours = rebuilt(model, dtype, backend)
    assert list(ours) == list(merged)
    for name, tensor in merged.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_factors_rebuild_the_merged_weights_bit_for_bit(make_qwen2, backend, dtype, weights):
    model = lora(make_qwen2(tie=True, dtype=weights), r=8, lora_alpha=16, target_modules="all-linear")
    factors = lora_factors(model)
    assert len(factors) == 7 * 2  # every linear layer of the two decoder layers (all-linear leaves the head out)
    assert all(name.endswith("_proj.weight") for name in factors)
    assert_bit_identical(model, dtype, backend)


def test_embeddings_conv1d_and_several_adapters(make_qwen2, make_gpt2):
    assert_bit_identical(lora(make_qwen2(tie=False), r=4, target_modules=["embed_tokens", "lm_head"]), torch.bfloat16)
    gpt2 = lora(make_gpt2(), r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    assert all(f.fan_in_fan_out for f in lora_factors(gpt2).values())
    assert_bit_identical(gpt2, torch.bfloat16)
    both = lora(make_qwen2(), r=4, target_modules=["q_proj", "up_proj"])
    both.add_adapter("other", LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False))
    both.base_model.set_adapter(["default", "other"])
    assert lora_factors(both)["model.layers.0.self_attn.q_proj.weight"].lora_A.shape[0] == 12  # ranks concatenated
    assert_bit_identical(both, torch.bfloat16)


def test_factors_are_views_of_the_adapter_and_scale_is_peft_s(make_qwen2):
    model = lora(make_qwen2(), r=8, lora_alpha=24, target_modules=["v_proj"])
    layer = model.base_model.model.model.layers[1].self_attn.v_proj
    factors = lora_factors(model)["model.layers.1.self_attn.v_proj.weight"]
    assert factors.lora_A.data_ptr() == layer.lora_A["default"].weight.data_ptr()
    assert factors.scale == 3.0
    assert not factors.fan_in_fan_out


def test_what_factors_cannot_carry_is_refused_naming_the_layer(make_qwen2):
    with pytest.raises(NotImplementedError, match=r"q_proj: an adapter with lora_bias=True"):
        lora_factors(lora(make_qwen2(), r=4, target_modules=["q_proj"], lora_bias=True))
    with pytest.raises(NotImplementedError, match=r"norm: a module trained whole \(modules_to_save\)"):
        lora_factors(lora(make_qwen2(), r=4, target_modules=["q_proj"], modules_to_save=["norm"]))


def test_expert_factors_rebuild_the_merged_experts(make_qwen3_moe):
    """Fused experts' factors are 3-D (`[E, r, in]`, `[E, out, r]`), named by the parameter they adapt, and merge
    with the grouped op into what the stream yields, bit for bit."""
    model = lora(make_qwen3_moe(dtype=torch.bfloat16), r=4, target_modules=["q_proj"],
                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    factors = lora_factors(model)
    gate_up = factors["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.lora_A.shape == (8, 4, 64)
    assert gate_up.lora_B.shape == (8, 64, 4)
    assert not gate_up.fan_in_fan_out
    adapted = ("self_attn.q_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    assert set(factors) == {f"model.layers.{i}.{n}" for i in range(2) for n in adapted}
    assert_bit_identical(model, torch.bfloat16)

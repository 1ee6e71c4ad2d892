"""`iter_merged_weights` against peft's own `merge_and_unload()` on real peft models (tiny, built in code)."""

import copy
import gc
import weakref

import pytest
import torch
from merge_reference import assert_merged_close, ulp
from peft import LoHaConfig, LoraConfig, get_peft_model
from torch import nn

from lorarl.lora_merge import adapted_weight_names, iter_merged_weights, merged_weight_specs
from lorarl.lora_merge._output import HAS_HUGE_PAGES, HUGE_PAGE_BYTES


def lora(model, **config):
    """A peft LoRA model with random (non-zero) A and B, so merging changes every targeted weight."""
    return get_peft_model(model, LoraConfig(init_lora_weights=False, **config))


def reference_state(peft_model, adapter_name=None):
    """peft's answer: merge a deep copy in place, unload, take its state dict."""
    copied = copy.deepcopy(peft_model)
    if adapter_name is not None:
        copied.set_adapter(adapter_name)
    return copied.merge_and_unload().state_dict()


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_as_peft(peft_model, **kwargs):
    before = snapshot(peft_model)
    ours = list(iter_merged_weights(peft_model, **kwargs))
    after = snapshot(peft_model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model is untouched, bit for bit

    reference = reference_state(peft_model, kwargs.get("adapter_name"))
    assert [name for name, _ in ours] == list(reference)  # same keys, same order
    for name, tensor in ours:
        expected = reference[name]
        assert tensor.dtype == expected.dtype, name
        assert tensor.shape == expected.shape, name
        tolerance = ulp(expected.double(), torch.bfloat16) if expected.dtype == torch.bfloat16 else 1e-5
        assert ((tensor.double() - expected.double()).abs() <= tolerance).all(), name
    return dict(ours)


@pytest.mark.parametrize("rank", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tie", [True, False])
def test_qwen2_all_linear(make_qwen2, rank, dtype, tie):
    merged = assert_same_as_peft(
        lora(make_qwen2(tie=tie, dtype=dtype), r=rank, lora_alpha=16, target_modules="all-linear")
    )
    assert not any("lora_" in k or "base_layer" in k for k in merged)


@pytest.mark.parametrize("rank", [1, 8, 64])
def test_gpt2_conv1d_fan_in_fan_out(make_gpt2, rank):
    model = lora(
        make_gpt2(dtype=torch.bfloat16), r=rank, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True
    )
    assert_same_as_peft(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_gpu(make_qwen2, make_gpt2, dtype):
    qwen2 = lora(make_qwen2(dtype=dtype).cuda(), r=16, target_modules="all-linear")
    gpt2 = lora(make_gpt2(dtype=dtype).cuda(), r=16, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    for model in (qwen2, gpt2):
        merged = assert_same_as_peft(model)
        assert all(tensor.is_cuda for tensor in merged.values())


def test_explicit_targets_with_exclusions_and_rslora(make_qwen2):
    model = lora(
        make_qwen2(dtype=torch.bfloat16),
        r=8,
        lora_alpha=32,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
        exclude_modules=["model.layers.1.self_attn.v_proj"],
    )
    assert "lora_A" not in dict(model.base_model.model.model.layers[1].self_attn.v_proj.named_children())
    assert_same_as_peft(model)


def test_embedding_lm_head_and_lora_bias(make_qwen2):
    assert_same_as_peft(lora(make_qwen2(tie=False), r=4, target_modules=["embed_tokens", "lm_head", "o_proj"]))
    assert_same_as_peft(lora(make_qwen2(), r=4, target_modules=["q_proj", "k_proj"], lora_bias=True))


def test_lora_on_a_tied_lm_head_changes_both_names_as_peft_does(make_qwen2):
    model = lora(make_qwen2(tie=True), r=4, target_modules=["lm_head"])
    merged = assert_same_as_peft(model)
    assert torch.equal(merged["lm_head.weight"], merged["model.embed_tokens.weight"])


def test_modules_to_save(make_qwen2):
    model = lora(make_qwen2(dtype=torch.bfloat16), r=8, target_modules=["q_proj"], modules_to_save=["norm"])
    model.base_model.model.model.norm.modules_to_save["default"].weight.data.fill_(3.0)  # as if trained
    merged = assert_same_as_peft(model)
    assert (merged["model.norm.weight"] == 3.0).all()


def test_several_adapters(make_qwen2):
    model = lora(make_qwen2(dtype=torch.bfloat16), r=4, target_modules=["q_proj", "up_proj"])
    model.add_adapter(
        "other", LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    )
    assert_same_as_peft(model)  # the active one ("default")
    assert_same_as_peft(model, adapter_name="other")
    model.set_adapter("other")
    assert_same_as_peft(model)
    model.base_model.set_adapter(["default", "other"])  # both active: merged together, one rounding
    exact = copy.deepcopy(model).double().merge_and_unload().state_dict()  # peft in float64: the exact sum
    for name, tensor in iter_merged_weights(model):
        rounded = exact[name].to(torch.bfloat16).double()
        assert ((tensor.double() - rounded).abs() <= ulp(rounded, torch.bfloat16)).all(), name
    # peft itself rounds after each adapter (twice); ours is the once-rounded exact sum


def test_dtype_casts_and_rounds_merged_weights_once(make_qwen2):
    model = lora(make_qwen2(dtype=torch.float32), r=8, target_modules="all-linear")
    reference = reference_state(model)
    for name, tensor in iter_merged_weights(model, dtype=torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        expected = reference[name].double()
        assert ((tensor.double() - expected).abs() <= ulp(expected, torch.bfloat16)).all(), name


def test_streams_one_module_at_a_time(make_qwen2):
    """Merged weights are made lazily and not kept: at most the one the consumer holds is alive."""
    model = lora(make_qwen2(), r=8, target_modules="all-linear")
    params = {p.data_ptr() for p in model.parameters()}
    alive = []
    for _, tensor in iter_merged_weights(model):
        if tensor.data_ptr() not in params:  # a freshly merged weight (others are views of the model's own)
            alive.append(weakref.ref(tensor))
        del tensor
        gc.collect()
        assert sum(ref() is not None for ref in alive) == 0
    assert len(alive) == 2 * 7  # every LoRA layer was merged


@pytest.mark.skipif(not HAS_HUGE_PAGES, reason="transparent huge pages: Linux")
def test_large_layers_are_merged_into_memory_on_huge_pages_reused_once_dropped():
    """32 MiB merged weights go to 2 MiB-aligned memory (see lorarl.lora_merge._output); a consumer looping over the
    stream still holds the last one while the next is merged, so the third reuses the first's memory. Checked against
    float64: over 16M elements some cancel, where peft's double rounding and ours differ by more than an ulp."""
    torch.manual_seed(5)
    layers = nn.Sequential(*(nn.Linear(8192, 2048, bias=False, dtype=torch.bfloat16) for _ in range(3)))
    model = lora(layers, r=4, target_modules=["0", "1", "2"])
    addresses = []
    for name, merged in iter_merged_weights(model):
        layer = model.base_model.model[len(addresses)]
        assert name == f"{len(addresses)}.weight"
        factors = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
        assert_merged_close(merged, layer.base_layer.weight, *factors)
        addresses.append(merged.data_ptr())
    assert all(address % HUGE_PAGE_BYTES == 0 for address in addresses)
    assert addresses[2] == addresses[0] != addresses[1]


def test_zero_drift_where_peft_bf16_merge_unmerge_drifts(make_qwen2):
    model = lora(make_qwen2(dtype=torch.bfloat16), r=16, lora_alpha=32, target_modules="all-linear")
    base = snapshot(model)
    for _ in range(100):
        for _ in iter_merged_weights(model):
            pass
    ours = max((v.double() - base[k].double()).abs().max().item() for k, v in model.state_dict().items())

    peft_model = copy.deepcopy(model)
    for _ in range(100):
        peft_model.merge_adapter()
        peft_model.unmerge_adapter()
    drift = max((v.double() - base[k].double()).abs().max().item() for k, v in peft_model.state_dict().items())
    assert ours == 0.0
    assert drift > 0.0


def test_already_merged_adapters_are_not_merged_twice(make_qwen2):
    model = lora(make_qwen2(), r=4, target_modules=["q_proj"])
    expected = reference_state(model)
    model.merge_adapter()  # W now holds W + BA; merge_and_unload would not add BA again
    for name, tensor in iter_merged_weights(model):
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6)


def test_inside_disable_adapter_the_base_weights_stream(make_qwen2):
    model = lora(make_qwen2(), r=4, target_modules="all-linear")
    with model.disable_adapter():  # what the model computes now: its base weights alone
        ours = dict(iter_merged_weights(model))
    base = copy.deepcopy(model).unload().state_dict()  # peft's own: the LoRA layers out, nothing merged
    assert list(ours) == list(base)
    assert all(torch.equal(ours[k], base[k]) for k in base)
    assert not all(torch.equal(a, b) for a, b in zip(ours.values(), reference_state(model).values(), strict=True))


def test_dora_and_other_tuners_are_refused_naming_the_layer(make_qwen2):
    dora = lora(make_qwen2(), r=4, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.self_attn\.q_proj.*DoRA"):
        list(iter_merged_weights(dora))
    loha = get_peft_model(make_qwen2(), LoHaConfig(r=4, target_modules=["v_proj"]))
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.self_attn\.v_proj"):
        list(iter_merged_weights(loha))


def test_a_plain_model_streams_its_state_dict(make_qwen2):
    model = make_qwen2()
    ours = list(iter_merged_weights(model))
    reference = model.state_dict()
    assert [k for k, _ in ours] == list(reference)
    assert all(torch.equal(v, reference[k]) for k, v in ours)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_merged_weight_specs_list_exactly_what_is_streamed_without_merging(make_qwen2, dtype):
    model = lora(make_qwen2(tie=True), r=4, target_modules="all-linear", modules_to_save=["norm"])
    specs = merged_weight_specs(model, dtype=dtype)
    streamed = [(name, t.shape, t.dtype) for name, t in iter_merged_weights(model, dtype=dtype)]
    assert specs == streamed


@pytest.mark.parametrize(
    "config",
    [
        {"target_modules": ["q_proj", "down_proj"]},
        {"target_modules": ["q_proj", "lm_head"]},  # a tied head: the embeddings change with it
        {"target_modules": ["v_proj"], "modules_to_save": ["lm_head"]},  # a module trained whole
    ],
)
def test_the_adapted_names_are_what_merging_changes_and_include_streams_them_alone(make_qwen2, config):
    """`adapted_weight_names` against peft's merge: every tensor `merge_and_unload` changes is named (and nothing the
    adapter cannot change but the adapted layers' biases); `include` streams those names alone, each equal to the
    whole stream's."""

    model = lora(make_qwen2(tie="lm_head" in config["target_modules"]), r=4, **config)
    names = adapted_weight_names(model)
    merged = reference_state(model)
    with model.disable_adapter():
        base = dict(iter_merged_weights(model))
    changed = [name for name, tensor in merged.items() if not torch.equal(tensor, base[name])]
    assert changed
    assert set(changed) <= set(names)
    whole = config.get("modules_to_save", [])  # trained whole: named though training has not changed it yet
    assert all(name in changed or name.endswith(".bias") or name.split(".")[0] in whole for name in names)
    streamed = dict(iter_merged_weights(model))
    subset = list(iter_merged_weights(model, include=set(names).__contains__))
    assert [name for name, _ in subset] == names
    assert all(torch.equal(tensor, streamed[name]) for name, tensor in subset)
    specs = merged_weight_specs(model, include=set(names).__contains__)
    assert [(name, tuple(shape)) for name, shape, _ in specs] == [(n, tuple(t.shape)) for n, t in subset]


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_fused_experts_merge_as_peft_merges_them(make_qwen3_moe, make_qwen2_moe, family, dtype):
    """LoRA on fused experts (peft's `target_parameters`: nested `ParamWrapper`s on `mlp.experts`), on attention, and
    on Qwen2-MoE's shared expert: the merged 3-D expert tensors under the model's own names, as peft merges them
    (in fp32: its `merge_and_unload`, and its own per-expert delta; in bf16, where peft rounds twice, each expert
    against float64 with peft's flat factors read column by column)."""
    make = make_qwen3_moe if family == "qwen3_moe" else make_qwen2_moe
    shared = ["shared_expert.gate_proj", "shared_expert.down_proj"] if family == "qwen2_moe" else []
    model = lora(make(dtype=dtype, moe_intermediate_size=24), r=4, lora_alpha=8, target_modules=["q_proj", *shared],
                 target_parameters=EXPERTS)  # fmt: skip
    experts = model.base_model.model.model.layers[1].mlp.experts  # the outer wrapper: down_proj; inside, gate_up
    assert type(experts.base_layer).__name__ == "ParamWrapper"
    if dtype == torch.float32:
        merged = assert_same_as_peft(model)
    else:
        merged = dict(iter_merged_weights(model))
        assert list(merged) == list(reference_state(model))
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    for wrapper in (experts, experts.base_layer):
        name = f"model.layers.1.mlp.experts.{wrapper.parameter_name}"
        weight = wrapper.get_param()
        assert merged[name].shape == weight.shape == ((8, 48, 64) if "gate_up" in name else (8, 64, 24))
        flat_A, flat_B = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
        if dtype == torch.float32:
            expected = weight + wrapper.get_delta_weight("default")
            torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-6)
        for e in range(8):  # expert e's rank k is column k·E + e of the flat B
            B_e = torch.stack([flat_B[:, k * 8 + e] for k in range(4)], dim=1)
            assert_merged_close(merged[name][e], weight[e], flat_A[4 * e : 4 * e + 4], B_e, wrapper.scaling["default"])
    if family == "qwen2_moe":
        assert "model.layers.1.mlp.shared_expert.gate_proj.weight" in merged


def test_experts_stored_in_out_merge_transposed():
    """A module keeping its experts `[E, in, out]` (`is_transposed`, as gpt-oss): peft adds each expert's delta
    transposed, and so does the stream."""

    class Experts(nn.Module):
        is_transposed = True

        def __init__(self):
            super().__init__()
            self.up = nn.Parameter(torch.randn(4, 16, 40))  # [E, in, out]

        def forward(self, x):
            return torch.einsum("bi,eio->beo", x, self.up)

    torch.manual_seed(3)
    model = lora(nn.Sequential(Experts()), r=3, target_modules=[], target_parameters=["0.up"])
    merged = assert_same_as_peft(model)
    assert merged["0.up"].shape == (4, 16, 40)


def test_expert_names_and_specs(make_qwen3_moe):
    model = lora(make_qwen3_moe(), r=4, target_modules=["o_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    names = adapted_weight_names(model)
    assert names == [f"model.layers.{i}.{n}" for i in range(2) for n in ("self_attn.o_proj.weight", EXPERTS[0])]
    specs = merged_weight_specs(model, dtype=torch.bfloat16)
    assert specs == [(n, t.shape, t.dtype) for n, t in iter_merged_weights(model, dtype=torch.bfloat16)]

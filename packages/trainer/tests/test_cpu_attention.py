"""The fp32 attention of 16-bit models on CPU (`cpu_attention`), in training and decode, against float64."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lorarl.trainer import cpu_attention
from lorarl.trainer.models import load_base

CPU = torch.device("cpu")


def attention(q, k, v, mask):
    """softmax(q kᵀ / √d + mask) v, as [B, S, H, D] (transformers' output layout); given float64 tensors."""
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def inputs(dtype, generator):
    q, k, v = (torch.randn(shape, generator=generator).to(dtype).requires_grad_()
               for shape in ((3, 4, 5, 16), (3, 4, 9, 16), (3, 4, 9, 16)))  # fmt: skip
    mask = torch.ones(3, 1, 5, 9, dtype=torch.bool).tril(4)  # 4 cached positions, then causal
    mask[0, :, :, :2] = False  # padding
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_training_attention_is_fp32_attention_rounded_once(dtype):
    generator = torch.Generator().manual_seed(0)
    q, k, v, mask = inputs(dtype, generator)
    module = nn.Module()
    out, _ = cpu_attention.cpu_sdpa(module, q, k, v, mask, scaling=None)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    exact = attention(q64, k64, v64, mask)
    assert out.dtype == dtype
    spacing = torch.finfo(dtype).eps * exact.detach().abs()  # an ulp of the result, at most
    assert ((out.double() - exact.detach()).abs() <= spacing + 1e-6).all()
    # gradients: those of the float64 attention, rounded to the 16-bit inputs' precision
    upstream = torch.randn(out.shape, generator=generator).to(dtype)
    out.backward(upstream)
    grads64 = torch.autograd.grad(exact, (q64, k64, v64), upstream.double())
    for got, exact_grad in zip((q.grad, k.grad, v.grad), grads64, strict=True):
        torch.testing.assert_close(got.double(), exact_grad, rtol=2 * torch.finfo(dtype).eps,
                                   atol=1e-5 * exact_grad.abs().max().item())  # fmt: skip


def test_a_prefill_without_gradients_runs_the_16_bit_kernel_unchanged():
    q, k, v, mask = inputs(torch.bfloat16, torch.Generator().manual_seed(1))
    module = nn.Module()
    with torch.no_grad():
        got, _ = cpu_attention.cpu_sdpa(module, q, k, v, mask)
        native, _ = sdpa_attention_forward(module, q, k, v, mask)
    assert torch.equal(got, native)


@pytest.mark.parametrize("padded", [True, False])
def test_a_decode_step_shares_kv_heads_and_rounds_fp32_attention_once(padded):
    """One query token, 6 query heads on 2 KV heads (GQA): the float64 attention with each KV head repeated for its
    query heads, within an ulp of bf16."""
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(3, 6, 1, 16, generator=generator).to(torch.bfloat16)
    k, v = (torch.randn(3, 2, 9, 16, generator=generator).to(torch.bfloat16) for _ in range(2))
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[0, :, :, :4] = False  # a left-padded prompt
    module = nn.Module()
    module.num_key_value_groups = 3
    with torch.no_grad():
        got, _ = cpu_attention.cpu_sdpa(module, q, k, v, mask if padded else None)
    repeated = [t.double().repeat_interleave(3, 1) for t in (k, v)]
    exact = attention(q.double(), *repeated, mask if padded else torch.ones_like(mask))
    assert got.shape == exact.shape == (3, 1, 6, 16)
    assert ((got.double() - exact).abs() <= torch.finfo(torch.bfloat16).eps * exact.abs() + 1e-6).all()


def test_a_gradient_through_the_values_alone_takes_the_fp32_path():
    """LoRA on v_proj only: the queries need no gradient, the values do."""
    q, k, v, mask = inputs(torch.bfloat16, torch.Generator().manual_seed(3))
    q, k = q.detach(), k.detach()
    out, _ = cpu_attention.cpu_sdpa(nn.Module(), q, k, v, mask)
    with torch.no_grad():
        fp32, _ = sdpa_attention_forward(nn.Module(), q.float(), k.float(), v.float(), mask)
    assert torch.equal(out.detach(), fp32.to(torch.bfloat16))
    out.sum().backward()
    assert v.grad is not None


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def float64_sdpa_copy(path, model):
    """The model at `path` in float64 with transformers' SDPA, holding `model`'s weights."""
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
    reference.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    return reference


@pytest.mark.parametrize(("dtype", "switched"), [(torch.bfloat16, True), (torch.float16, True),
                                                 (torch.float32, False)])  # fmt: skip
def test_load_base_switches_16_bit_cpu_models_only(tiny_llama, dtype, switched):
    model = load_base(tiny_llama, dtype, CPU)
    expected = cpu_attention.NAME if switched else "sdpa"
    assert model.config._attn_implementation == expected


def test_a_switched_model_computes_the_float64_models_logits(tiny_llama):
    """Padding and causality reach the new kernel as they reach SDPA: the bf16 model's logits under autograd match a
    float64 SDPA copy of its weights (a lost mask moves them far beyond bf16's rounding)."""
    model = load_base(tiny_llama, torch.bfloat16, CPU)
    reference = float64_sdpa_copy(tiny_llama, model)
    ids = torch.randint(1, 97, (3, 12), generator=torch.Generator().manual_seed(2))
    attention = torch.ones(3, 12, dtype=torch.long)
    attention[0, :5] = 0  # left padding
    logits = model(input_ids=ids, attention_mask=attention).logits
    assert logits.requires_grad
    with torch.no_grad():
        exact = reference(input_ids=ids, attention_mask=attention).logits
    valid = attention.bool()
    error = (logits.detach().double() - exact)[valid].abs().max() / exact[valid].abs().max()
    assert error < 0.02
    logits[valid].float().logsumexp(-1).sum().backward()  # the backward runs through the fp32 attention
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_switched_model_decodes_as_the_float64_model(tiny_llama):
    """A prefill, then decode steps on the KV cache (one token each, GQA, left padding), without gradients: the
    logits of each step match a float64 SDPA copy's."""
    model = load_base(tiny_llama, torch.bfloat16, CPU)
    reference = float64_sdpa_copy(tiny_llama, model)
    ids = torch.randint(1, 97, (3, 8), generator=torch.Generator().manual_seed(5))
    attention = torch.ones(3, 8, dtype=torch.long)
    attention[0, :3] = 0
    steps = torch.randint(1, 97, (3, 4), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        outs = {}
        for name, m in (("bf16", model), ("float64", reference)):
            out = m(input_ids=ids, attention_mask=attention, use_cache=True)
            mask, logits = attention, []
            for token in steps.T:
                mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
                out = m(input_ids=token[:, None], attention_mask=mask, past_key_values=out.past_key_values,
                        use_cache=True)  # fmt: skip
                logits.append(out.logits[:, -1].double())
            outs[name] = torch.stack(logits)
    error = (outs["bf16"] - outs["float64"]).abs().max() / outs["float64"].abs().max()
    assert error < 0.02

"""The HF worker's decode loop against independent references: Hugging Face `generate` (greedy), a full forward of
each prompt + response (its log-probs, so also the KV cache under left padding), transformers' top-p warper, and the
empirical distribution of many draws; with the LM head whole and in slices of the vocabulary."""

import contextlib

import pytest
import torch
from tiny_models import tiny_gpt2, tiny_qwen2

from lorarl.trainer import decode as decode_module
from lorarl.trainer.decode import decode, nucleus, sample, vocab_sliced

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]
PAD, EOS = 0, 1


def left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture(params=[None, 48], ids=["head-whole", "head-in-slices"])
def head_slices(request, monkeypatch):
    """The tiny models' fp32 LM head (128 x 64) whole (smaller than a slice), or in slices of 48 rows (the last of
    32)."""
    if request.param is not None:
        monkeypatch.setattr(decode_module, "HEAD_SLICE_BYTES", request.param * 64 * 4)


@pytest.mark.parametrize("make", [tiny_qwen2, tiny_gpt2])
@pytest.mark.parametrize("n", [1, 3])
def test_greedy_equals_hugging_face_generate(make, n, head_slices):
    """With n > 1 the prompt's prefill is shared: each of its n rows continues from the same cache."""
    model = make()
    ids, mask = left_padded(PROMPTS)
    tokens, _ = decode(model, ids, mask, n=n, max_tokens=7, temperature=0.0, top_p=1.0, eos=EOS, pad=PAD)
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False,
                               pad_token_id=PAD, eos_token_id=EOS)[:, ids.shape[1] :]  # fmt: skip
    assert tokens.tolist() == reference.repeat_interleave(n, 0).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_log_probs_are_the_full_forward_ones_at_the_temperature(temperature, head_slices):
    model = tiny_qwen2()
    ids, mask = left_padded(PROMPTS)
    g = torch.Generator().manual_seed(3)
    tokens, logp = decode(model, ids, mask, n=2, max_tokens=6, temperature=temperature, top_p=1.0, eos=EOS, pad=PAD,
                          generator=g)  # fmt: skip
    assert not torch.equal(tokens[0], tokens[1])  # a prompt's two responses are drawn apart
    for i, prompt in enumerate(p for p in PROMPTS for _ in range(2)):
        response = tokens[i].tolist()
        length = response.index(EOS) + 1 if EOS in response else len(response)  # pads after EOS score 0
        response = response[:length]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float() / temperature
        want = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(logp[i, :length], want, atol=1e-5, rtol=0)
        assert (logp[i, length:] == 0).all()


@pytest.mark.parametrize("bias", [False, True])
def test_a_vocab_sliced_head_computes_the_float64_logits(monkeypatch, bias):
    monkeypatch.setattr(decode_module, "HEAD_SLICE_BYTES", 48 * 64 * 4)
    head = torch.nn.Linear(64, 128, bias=bias)
    hidden = torch.randn(3, 5, 64)
    with torch.no_grad(), vocab_sliced(head):
        assert "forward" in vars(head)  # replaced for the duration
        got = head(hidden)
    assert "forward" not in vars(head)
    bias64 = None if head.bias is None else head.bias.double()
    want = torch.nn.functional.linear(hidden.double(), head.weight.double(), bias64)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "head", [torch.nn.Linear(64, 128).bfloat16(), torch.nn.Embedding(128, 64), torch.nn.Linear(64, 128)]
)  # the last fits in one slice
def test_heads_other_than_a_float32_linear_are_left_alone(head):
    with vocab_sliced(head):
        assert "forward" not in vars(head)


def test_rows_end_at_eos_then_pad():
    model = tiny_qwen2()
    with torch.no_grad():  # make EOS the likeliest next token after token 4
        model.get_output_embeddings().weight[EOS] = model.get_input_embeddings().weight[4] * 50
    ids, mask = left_padded([[4, 4, 4], [9, 9, 9]])
    tokens, logp = decode(model, ids, mask, max_tokens=5, temperature=0.0, top_p=1.0, eos=EOS, pad=PAD)
    row = tokens[0].tolist()
    end = row.index(EOS)
    assert row[end + 1 :] == [PAD] * (len(row) - end - 1)
    assert (logp[0, end + 1 :] == 0).all()


def test_the_same_seed_draws_the_same_samples():
    model = tiny_qwen2()
    ids, mask = left_padded(PROMPTS)
    runs = [decode(model, ids, mask, max_tokens=5, temperature=1.0, top_p=0.9, eos=EOS, pad=PAD,
                   generator=torch.Generator().manual_seed(seed)) for seed in (7, 7, 8)]  # fmt: skip
    assert torch.equal(runs[0][0], runs[1][0])
    assert not torch.equal(runs[0][0], runs[2][0])


@pytest.mark.parametrize("top_p", [0.3, 0.75, 0.95, 1.0])
def test_nucleus_equals_transformers_top_p_warper(top_p):
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 2
    warped = torch.softmax(TopPLogitsWarper(top_p=top_p)(None, logits.clone()), -1)
    torch.testing.assert_close(nucleus(torch.softmax(logits, -1), top_p), warped)


def test_draws_follow_the_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3], [0.05, 0.05, 0.0, 0.9]])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(probs, g) for _ in range(20000)], 1)
    for row in range(2):
        freq = torch.bincount(draws[row], minlength=4).double() / draws.shape[1]
        torch.testing.assert_close(freq, probs[row].double(), atol=0.015, rtol=0)  # ~4 standard errors
        assert (freq[probs[row] == 0] == 0).all()  # never a token of probability 0


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_min_tokens_draws_without_eos_from_the_renormalised_distribution(temperature):
    """A model whose likeliest token is EOS still runs `min_tokens`: those tokens' log-probs are the full forward's
    with EOS removed and the rest renormalised (vLLM's `min_tokens`); after them EOS ends the rows."""
    model = tiny_qwen2()
    head = model.lm_head
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features)  # EOS dominates after any context
    with torch.no_grad():
        model.lm_head.weight.copy_(head.weight)
        model.lm_head.bias.zero_()[EOS] = 30.0
    ids, mask = left_padded(PROMPTS)
    n = 1 if temperature == 0 else 2
    tokens, logp = decode(model, ids, mask, n=n, max_tokens=8, temperature=temperature, top_p=1.0, eos=EOS, pad=PAD,
                          generator=torch.Generator().manual_seed(0), min_tokens=5)  # fmt: skip
    free, _ = decode(model, ids, mask, n=n, max_tokens=8, temperature=temperature, top_p=1.0, eos=EOS, pad=PAD,
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert (free[:, 0] == EOS).all()  # without min_tokens every row ends at once
    assert (tokens[:, :5] != EOS).all()
    assert (tokens[:, 5] == EOS).all()
    for i, prompt in enumerate(p for p in PROMPTS for _ in range(n)):
        response = tokens[i, :6].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].double()
        logits[:5, EOS] = float("-inf")
        want = torch.log_softmax(logits / (temperature or 1.0), -1).gather(1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(logp[i, :6].double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_grown_in_place_decodes_what_a_concatenated_one_decodes(monkeypatch, dtype):
    """The buffers allocated once per decode (float32 for a bf16 model attended in float32 by `cpu_attention`) give
    bit for bit the tokens and log-probs of transformers' cache grown by concatenation."""
    from lorarl.trainer import cpu_attention

    model = tiny_qwen2(dtype=dtype)
    cpu_attention.use_on_cpu(model, torch.device("cpu"))
    ids, mask = left_padded(PROMPTS)
    grown = []
    grow = decode_module.grow_in_place

    def recorded(model, cache, room):
        grow(model, cache, room)
        grown.extend(cache.layers)

    def run():
        return decode(model, ids, mask, n=2, max_tokens=9, temperature=1.0, top_p=1.0, eos=EOS, pad=PAD,
                      generator=torch.Generator().manual_seed(5))  # fmt: skip

    monkeypatch.setattr(decode_module, "grow_in_place", recorded)
    tokens, logp = run()
    assert {type(layer) for layer in grown} == {decode_module.GrowingLayer}
    assert {layer.dtype for layer in grown} == {torch.float32}
    assert grown[0].length == ids.shape[1] + tokens.shape[1] - 1  # every step's keys, in place
    monkeypatch.setattr(decode_module, "grow_in_place", lambda *_: None)
    concatenated = run()
    assert torch.equal(tokens, concatenated[0])
    assert torch.equal(logp, concatenated[1])


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 on this CPU")
def test_packed_linears_decode_bit_for_bit_what_plain_linears_decode(monkeypatch):
    """A bf16 model's linear layers computing from oneDNN-packed weights during a decode (the LM head too) give the
    tokens and log-probs of torch's own linear, and are plain linears again afterwards."""
    model = tiny_qwen2(dtype=torch.bfloat16)
    ids, mask = left_padded(PROMPTS)
    packed = []
    pack = decode_module.packed_linears

    @contextlib.contextmanager
    def recorded(model):
        with pack(model):
            packed.extend(m for m in model.modules() if "forward" in vars(m))
            yield

    def run():
        return decode(model, ids, mask, n=2, max_tokens=9, temperature=1.0, top_p=1.0, eos=EOS, pad=PAD,
                      generator=torch.Generator().manual_seed(5))  # fmt: skip

    monkeypatch.setattr(decode_module, "packed_linears", recorded)
    tokens, logp = run()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert packed == linears  # every one, the LM head included
    assert not any("forward" in vars(m) for m in linears)
    monkeypatch.setattr(decode_module, "packed_linears", lambda _: contextlib.nullcontext())
    plain = run()
    assert torch.equal(tokens, plain[0])
    assert torch.equal(logp, plain[1])

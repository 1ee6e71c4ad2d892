"""The chunked LM-head log-probs and entropies equal the plain computation (full logits, log-softmax, gather) in
float64, values and gradients, whatever the chunking."""

import pytest
import torch

from lorarl.trainer import head_logprobs as module
from lorarl.trainer.head_logprobs import head_logprobs


def plain(hidden, weight, bias, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    log_p = torch.log_softmax(logits, -1)
    return log_p.gather(1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)


def inputs(tokens=37, hidden=12, vocab=29, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(vocab, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    return h, w, b, torch.randint(0, vocab, (tokens,), generator=g)


def grads(outputs, weights, params):
    loss = sum((o * w).sum() for o, w in zip(outputs, weights, strict=True) if w is not None)
    return torch.autograd.grad(loss, [p for p in params if p is not None and p.requires_grad])


@pytest.mark.parametrize("chunk_elements", [29 * 5, 29 * 37, 1 << 23])  # 8 chunks (the last short), one, one
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use_entropy", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("frozen_head", [False, True], ids=["trained-head", "frozen-head"])
def test_values_and_gradients_equal_the_plain_computation(monkeypatch, chunk_elements, temperature, use_entropy, bias,
                                                          frozen_head):  # fmt: skip
    """A trained head recomputes the logits in the backward; a frozen one (LoRA) forms its gradient in the forward."""
    monkeypatch.setattr(module, "CHUNK_ELEMENTS", chunk_elements)
    h, w, b, targets = inputs(bias=bias)
    if frozen_head:
        w, b = w.detach(), (b.detach() if bias else None)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(h.shape[0], dtype=torch.float64, generator=g),
               torch.randn(h.shape[0], dtype=torch.float64, generator=g) if use_entropy else None]  # fmt: skip
    got = head_logprobs(h, w, b, targets, temperature=temperature)
    want = plain(h, w, b, targets, temperature)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    for a, e in zip(grads(got, weights, [h, w, b]), grads(want, weights, [h, w, b]), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_an_entropy_without_its_gradient_refuses_one():
    h, w, _, targets = inputs(bias=False)
    logp, entropy = head_logprobs(h, w.detach(), None, targets, entropy_grad=False)
    (grad,) = torch.autograd.grad(logp.sum(), [h], retain_graph=True)  # the log-probs' gradient is there
    torch.testing.assert_close(grad, torch.autograd.grad(plain(h, w.detach(), None, targets, 1.0)[0].sum(), [h])[0])
    with pytest.raises(RuntimeError, match="entropy_grad=False"):
        entropy.sum().backward()


def test_fp32_inputs_reduce_in_fp32():
    h, w, b, targets = inputs()
    logp, entropy = head_logprobs(h.float(), w.float(), b.float(), targets)
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp.double(), plain(h, w, b, targets, 1.0)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.zeros(3, 4), torch.zeros(5, 3), None, torch.zeros(3, dtype=torch.long)), "weight"),
        ((torch.zeros(3, 4), torch.zeros(5, 4), None, torch.zeros(2, dtype=torch.long)), "targets"),
    ],
)
def test_bad_shapes_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        head_logprobs(*args)


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        head_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), None, torch.zeros(3, dtype=torch.long), temperature=0)

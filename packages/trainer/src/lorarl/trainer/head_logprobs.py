"""Log-probs and entropies of chosen tokens straight from hidden states and the LM head's weight, chunked over tokens.

`[tokens, vocab]` logits are the largest tensors of an RL step (a 2k-token micro-batch at a 150k vocabulary is 1.2 GB in
fp32, and autograd keeps several such). Here they exist for one chunk of tokens at a time. With a frozen head (LoRA)
the forward also forms each token's gradient vector in the hidden state, so the backward is a scaling; with a trained
head the backward recomputes each chunk's logits to form its gradients (the idea of Liger-Kernel's fused linear
cross-entropy). Logits are computed in the head's dtype and reduced in fp32 (fp64 stays fp64).
"""

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor, nn

CHUNK_ELEMENTS = 1 << 23  # logits per chunk: 32 MiB in fp32, whatever the vocabulary


def chunk_tokens(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, inv_temperature: float,
                entropy_grad: bool, ahead: bool):  # fmt: skip
        ctx.set_materialize_grads(False)
        reduce_dtype = torch.promote_types(hidden.dtype, torch.float32)
        logp = torch.empty(hidden.shape[0], dtype=reduce_dtype, device=hidden.device)
        entropy = torch.empty_like(logp)
        d_logp = torch.empty_like(hidden, dtype=reduce_dtype) if ahead else None
        d_entropy = torch.empty_like(hidden, dtype=reduce_dtype) if ahead and entropy_grad else None
        step = chunk_tokens(weight.shape[0])
        for start in range(0, hidden.shape[0], step):
            end = min(start + step, hidden.shape[0])
            log_p = torch.log_softmax(_logits(hidden[start:end], weight, bias, inv_temperature, reduce_dtype), -1)
            p = log_p.exp()
            logp[start:end] = log_p.gather(1, targets[start:end, None])[:, 0]
            entropy[start:end] = -torch.bmm(p[:, None, :], log_p[:, :, None])[:, 0, 0]
            if d_logp is not None:  # d log p_y / dh = (W_y - Σ_k p_k W_k) / T
                expected = (p.to(weight.dtype) @ weight).to(reduce_dtype)
                d_logp[start:end] = (weight[targets[start:end]].to(reduce_dtype) - expected) * inv_temperature
            if d_entropy is not None:  # dH / dh = -Σ_k p_k (log p_k + H) W_k / T
                spread = p.mul_(log_p.add_(entropy[start:end, None]))
                d_entropy[start:end] = -(spread.to(weight.dtype) @ weight).to(reduce_dtype) * inv_temperature
        ctx.save_for_backward(hidden, weight, bias, targets, entropy, d_logp, d_entropy)
        ctx.inv_temperature, ctx.ahead, ctx.entropy_grad = inv_temperature, ahead, entropy_grad
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, bias, targets, entropy, d_logp, d_entropy = ctx.saved_tensors
        if grad_entropy is not None and not ctx.entropy_grad:
            raise RuntimeError("head_logprobs(entropy_grad=False): the entropy was computed without its gradient")
        if ctx.ahead:
            grad = torch.zeros_like(d_logp)
            if grad_logp is not None:
                grad.addcmul_(grad_logp[:, None], d_logp)
            if grad_entropy is not None:
                grad.addcmul_(grad_entropy[:, None], d_entropy)
            return grad.to(hidden.dtype), None, None, None, None, None, None
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=entropy.dtype) if needs_weight else None
        grad_bias = torch.zeros_like(bias, dtype=entropy.dtype) if needs_bias else None
        if grad_logp is None and grad_entropy is None:
            return grad_hidden, grad_weight, grad_bias, None, None, None, None
        step = chunk_tokens(weight.shape[0])
        for start in range(0, hidden.shape[0], step):  # the logits again, chunk by chunk
            end = min(start + step, hidden.shape[0])
            h = hidden[start:end]
            log_p = torch.log_softmax(_logits(h, weight, bias, ctx.inv_temperature, entropy.dtype), -1)
            p = log_p.exp()
            dz = torch.zeros_like(p)
            if grad_logp is not None:  # d log p_y / dz = onehot(y) - p
                g = grad_logp[start:end, None]
                dz.sub_(p * g).scatter_add_(1, targets[start:end, None], g)
            if grad_entropy is not None:  # dH / dz_k = -p_k (log p_k + H)
                dz.sub_(grad_entropy[start:end, None] * p * (log_p + entropy[start:end, None]))
            dz.mul_(ctx.inv_temperature)
            if needs_hidden:
                grad_hidden[start:end] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if needs_weight:
                grad_weight.addmm_(dz.T, h.to(dz.dtype))
            if needs_bias:
                grad_bias.add_(dz.sum(0))
        return grad_hidden, _cast(grad_weight, weight), _cast(grad_bias, bias), None, None, None, None


def _cast(grad: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if grad is None else grad.to(like.dtype)


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, inv_temperature: float, dtype: torch.dtype) -> Tensor:
    z = torch.nn.functional.linear(h.to(weight.dtype), weight, bias).to(dtype)
    return z.mul_(inv_temperature) if inv_temperature != 1.0 else z


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """`(log p(target), entropy)` per row of `hidden` (`[T, H]`) under softmax((hidden @ weight.T + bias) / T), T the
    temperature; both `[T]` in fp32 (fp64 for fp64 inputs), differentiable in hidden, weight and bias.
    `entropy_grad=False`: the entropy is a metric only (no gradient flows through it), which saves work."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [T, H] and weight [V, H]; got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [T] = {tuple(hidden.shape[:1])}, got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # A frozen head (LoRA): each output's gradient in `hidden` is its upstream gradient (one scalar per token) times a
    # vector known in the forward, so the backward needs neither the logits again nor a pass over the vocabulary.
    frozen = not weight.requires_grad and (bias is None or not bias.requires_grad)
    ahead = torch.is_grad_enabled() and hidden.requires_grad and frozen
    return _HeadLogprobs.apply(hidden, weight, bias, targets, 1.0 / temperature, entropy_grad, ahead)


@contextlib.contextmanager
def head_replaced(head: nn.Module, forward: Callable[[Tensor], Tensor]):
    """The LM head computes `forward(hidden_states)` instead of logits for the duration: it runs inside the model's
    own forward, so wrappers that manage its weight there (FSDP) see an ordinary call."""
    head.forward = forward
    try:
        yield
    finally:
        del head.forward

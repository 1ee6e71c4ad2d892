"""The HF rollout worker's decode loop: a Hugging Face causal LM with its KV cache, sampled directly.

Why not `model.generate`: on CPU its sampler (`torch.multinomial` over the vocabulary) is a large share of the decode
time, it keeps every step's logits to return them, and it scores the prompt's last position only after computing
logits for all of them. Here the prefill computes one position's logits, each step draws by inverse CDF
(one cumulative sum per row, then a binary search), and only the sampled tokens' log-probs are kept. The `n`
responses to a prompt share one prefill: its KV cache is computed once and repeated (a GRPO group of 8 prefilled 8
times was most of a short rollout's work).

The KV cache grows into buffers allocated once for the whole response (`GrowingLayer`), not by concatenation: a
cache grown by `torch.cat` copies all of itself at every step, quadratic in the response's length. On a CPU a 16-bit
model's cache is kept in float32 where `cpu_attention` attends in float32 anyway (it would otherwise cast the whole
cache at every step): the same values, as each new key and value is cast once.

On a CPU with native bf16 the bf16 linear layers compute with weights reordered once per decode into oneDNN's blocked
layout (`packed_linears`), as vLLM's CPU build does: a decode step's matmuls of a few rows took 0.73 of the time on
Zen 4, with the same results.

On CPU a float32 LM head larger than a slice is applied a slice of the vocabulary at a time (`vocab_sliced`): torch's
GEMM of a few rows against a whole vocabulary is slower than the same work in slices that stay in cache
(`benchmarks/decode_head.py` measures it).
"""

import contextlib
import functools

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicLayer

from lorarl.trainer import cpu_attention
from lorarl.trainer.head_logprobs import head_replaced

HEAD_SLICE_BYTES = 2 << 20  # of the head's weight per GEMM: about a core's share of L2


def nucleus(probs: Tensor, top_p: float) -> Tensor:
    """`probs` restricted to the smallest set of most likely tokens whose mass reaches `top_p`, renormalised (the
    most likely token always stays)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # mass before a token already reaches top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: Tensor, generator: torch.Generator | None = None, uniforms: Tensor | None = None) -> Tensor:
    """One token per row of `probs` (`[B, V]`, rows summing to 1), by inverse CDF of `uniforms` (`[B]` in [0, 1);
    drawn from `generator` when None)."""
    cdf = probs.cumsum(-1)
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=cdf.dtype)
    u = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


MASK32 = 0xFFFFFFFF


def mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int: a key's bits spread over all 64."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def keyed_uniforms(keys: Tensor, step: int) -> Tensor:
    """`[B]` float32 uniforms in [0, 1), each a hash of its row's key (int64 `[B]`, below 2**32) and `step` alone:
    a row's draws do not depend on the other rows of its batch (an episode's samples, whatever else is decoding).
    The products stay below 2**63 (32-bit values, 31-bit multipliers): exact in int64."""
    x = keys ^ (mix64(step) & MASK32)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x346CA68B) & MASK32
    x = x ^ (x >> 16)
    return (x >> 8).to(torch.float32) / float(1 << 24)


def row_keys(seeds: list[int], device) -> Tensor:
    """The per-row keys of `keyed_uniforms` for rows seeded `seeds`."""
    return torch.tensor([mix64(seed) & MASK32 for seed in seeds], dtype=torch.int64, device=device)


@contextlib.contextmanager
def vocab_sliced(head: nn.Module):
    """For the duration, a float32 `nn.Linear` head on the CPU larger than `HEAD_SLICE_BYTES` computes its logits that
    much of its weight at a time, into one output (each logit is the same dot product; other heads are left as they
    are)."""
    large = (type(head) is nn.Linear and head.weight.device.type == "cpu" and head.weight.dtype == torch.float32
             and head.weight.nbytes > HEAD_SLICE_BYTES)  # fmt: skip
    if not large:
        yield
        return
    rows = max(1, HEAD_SLICE_BYTES // (head.in_features * head.weight.element_size()))

    def forward(hidden: Tensor) -> Tensor:
        flat = hidden.reshape(-1, head.in_features)
        out = flat.new_empty(flat.shape[0], head.out_features)
        for start in range(0, head.out_features, rows):
            weight = head.weight[start : start + rows].t()
            if head.bias is None:
                torch.mm(flat, weight, out=out[:, start : start + rows])
            else:
                torch.addmm(head.bias[start : start + rows], flat, weight, out=out[:, start : start + rows])
        return out.view(*hidden.shape[:-1], head.out_features)

    with head_replaced(head, forward):
        yield


@contextlib.contextmanager
def packed_linears(model: nn.Module):
    """For the duration, each bf16 `nn.Linear` of `model` on a CPU with native bf16 computes from its weight reordered
    into oneDNN's blocked layout (a copy, made here; the weights may change between decodes). Others are left."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"
               and m.weight.dtype == torch.bfloat16 and "forward" not in vars(m)]  # fmt: skip
    if not linears or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        yield
        return
    for linear in linears:
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        linear.forward = functools.partial(_packed_linear, packed, linear.bias)
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward


def _packed_linear(weight: Tensor, bias: Tensor | None, x: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class GrowingLayer(DynamicLayer):
    """A layer's KV cache in buffers of a fixed capacity: each step writes its keys and values in place and attends
    to a view of those so far (transformers' `DynamicLayer` otherwise: masks and lengths as it computes them)."""

    def __init__(self, prefilled: DynamicLayer, capacity: int, dtype: torch.dtype):
        super().__init__()
        batch, heads, _length, dim = prefilled.keys.shape
        self.buffers = [torch.empty(batch, heads, capacity, dim, dtype=dtype, device=prefilled.keys.device)
                        for _ in range(2)]  # fmt: skip
        self.length = 0
        self.is_initialized = True
        self.dtype, self.device = dtype, prefilled.keys.device
        self.update(prefilled.keys, prefilled.values)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        end = self.length + key_states.shape[-2]
        keys, values = self.buffers
        keys[:, :, self.length : end].copy_(key_states)
        values[:, :, self.length : end].copy_(value_states)
        self.length = end
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values


def grow_in_place(model: nn.Module, cache, room: int) -> None:
    """The prefilled `cache`'s plain layers as `GrowingLayer`s with `room` more positions (other layers, e.g. sliding
    windows, are left as they are); float32 for a 16-bit model that `cpu_attention` serves."""
    fp32 = getattr(model.config, "_attn_implementation", None) == cpu_attention.NAME
    for i, layer in enumerate(getattr(cache, "layers", ())):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            dtype = torch.float32 if fp32 and layer.keys.dtype in cpu_attention.SIXTEEN_BIT else layer.keys.dtype
            cache.layers[i] = GrowingLayer(layer, layer.keys.shape[-2] + room, dtype)


class StopStrings:
    """Ends a row of one decode call when its response comes to contain one of `strings` (the end of a tool call),
    as vLLM's `stop` does, and remembers where: `ends[row]` is the response's length with the token that completed
    it. Only a token whose text holds a string's last character can complete one (`candidates`, `[V]`): those rows
    alone decode their tail."""

    def __init__(self, tokenizer, strings: tuple[str, ...], candidates: Tensor):
        self.tokenizer, self.strings, self.candidates = tokenizer, strings, candidates
        self.longest = max(map(len, strings))
        self.ends: dict[int, int] = {}

    @staticmethod
    def candidates_of(tokenizer, strings: tuple[str, ...], vocab_size: int) -> Tensor:
        """`[vocab_size]`: the tokens whose text holds the last character of one of `strings` — decoded (a byte-level
        vocabulary spells "\n" as "Ċ") or as the vocabulary spells it (a byte of a multi-byte character decodes to
        nothing whole)."""
        last = {s[-1] for s in strings}
        ids = list(range(min(len(tokenizer), vocab_size)))
        spelt, decoded = tokenizer.convert_ids_to_tokens(ids), tokenizer.batch_decode([[i] for i in ids])
        hits = [i for i in ids if any(c in (spelt[i] or "") + decoded[i] for c in last)]
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[hits] = True
        return mask

    def __call__(self, history: list[Tensor], token: Tensor, ended: Tensor) -> Tensor:
        """Which rows the newest `token` ends (`history`: every step's tokens so far, the newest included)."""
        hits = self.candidates.to(token.device)[token] & ~ended
        stopped = torch.zeros_like(ended)
        for row in hits.nonzero()[:, 0].tolist():
            tail = [int(step[row]) for step in history[-self.longest :]]  # each token is a character or more
            if any(s in self.tokenizer.decode(tail) for s in self.strings):
                stopped[row] = True
                self.ends[row] = len(history)
        return stopped


def left_padded(prompts: list[list[int]], pad: int, device) -> tuple[Tensor, Tensor]:
    """`(input_ids, attention_mask)` `[B, P]` of `prompts`, padded on the left (what `decode` takes)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def response_end(tokens: list[int], eos: int, stop_end: int | None) -> tuple[int, bool]:
    """`(length, finished)` of one decoded row: through its stop (`stop_end`, the length with the token that ended
    it, as `StopStrings.ends` records), else through `eos`, else cut at `max_tokens` (not finished)."""
    if stop_end is not None:
        return stop_end, True
    if eos in tokens:
        return tokens.index(eos) + 1, True
    return len(tokens), False


@torch.no_grad()
def decode(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    n: int = 1,
    max_tokens: int,
    temperature: float,
    top_p: float,
    eos: int,
    pad: int,
    generator: torch.Generator | None = None,
    stop: StopStrings | None = None,
    min_tokens: int = 0,
    adapter_names: list[str] | None = None,
    seeds: list[int] | None = None,
    limits: list[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """`n` responses to each left-padded prompt `[B, P]`: `(tokens [B·n, T], logp [B·n, T])` (prompt i's responses
    in rows i·n to i·n + n - 1), T <= max_tokens. Greedy when `temperature` is 0. `logp` is each token's log-prob
    under softmax(logits / temperature) (the raw distribution when greedy); after a row's `eos` its tokens are `pad`
    and its log-probs 0 — as after a stop string of `stop`. Stops when every row has ended. The first `min_tokens`
    tokens of a row are drawn with `eos` removed from the distribution (vLLM's `min_tokens`; their log-probs are of the
    distribution drawn from), and a stop string ends a row only after them. `adapter_names` (a peft model): each
    prompt's adapter, a batch of several adapters (peft's mixed-batch forward). `seeds` (one per row, `[B·n]`): each
    row draws from a stream of its own seed (`keyed_uniforms`) instead of `generator`; `limits` (one per row): a
    row ends after that many tokens (`max_tokens` is then their largest)."""
    with vocab_sliced(model.get_output_embeddings()), packed_linears(model):
        return _decode(model, input_ids, attention_mask, n, max_tokens, temperature, top_p, eos, pad, generator, stop,
                       min_tokens, adapter_names, seeds, limits)  # fmt: skip


def _decode(model, input_ids, attention_mask, n, max_tokens, temperature, top_p, eos, pad, generator, stop, min_tokens,
            adapter_names, seeds, limits):  # fmt: skip
    mask = attention_mask.long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    routed = {} if adapter_names is None else {"adapter_names": list(adapter_names)}
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                **routed)  # fmt: skip
    if adapter_names is not None:
        routed = {"adapter_names": [name for name in adapter_names for _ in range(n)]}
    if n > 1:
        out.past_key_values.batch_repeat_interleave(n)
        out.logits = out.logits.repeat_interleave(n, 0)
        mask, positions = mask.repeat_interleave(n, 0), positions.repeat_interleave(n, 0)
    grow_in_place(model, out.past_key_values, max_tokens - 1)  # the last token is sampled, never attended to
    batch = mask.shape[0]
    greedy = temperature <= 0
    ended = torch.zeros(batch, dtype=torch.bool, device=mask.device)
    keys = None if seeds is None else row_keys(seeds, mask.device)
    limit = None if limits is None else torch.tensor(limits, device=mask.device)
    tokens, logps = [], []
    for step in range(max_tokens):
        logits = out.logits[:, -1].float()
        if step < min_tokens:
            logits[:, eos] = float("-inf")
        log_p = torch.log_softmax(logits if greedy else logits / temperature, -1)
        uniforms = None if keys is None or greedy else keyed_uniforms(keys, step)
        token = logits.argmax(-1) if greedy else sample(nucleus(log_p.exp(), top_p), generator, uniforms)
        token = token.masked_fill(ended, pad)
        tokens.append(token)
        logps.append(log_p.gather(1, token[:, None])[:, 0].masked_fill(ended, 0.0))
        ended |= token == eos
        if stop is not None and step >= min_tokens:
            ended |= stop(tokens, token, ended)
        if limit is not None:
            ended |= limit <= step + 1
        if bool(ended.all()) or step == max_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                    past_key_values=out.past_key_values, use_cache=True, **routed)  # fmt: skip
    return torch.stack(tokens, 1), torch.stack(logps, 1)

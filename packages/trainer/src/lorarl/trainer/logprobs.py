"""Per-token log-probs (and entropies) of responses: micro-batches in the layout that suits the attention kernel.

Two layouts, the same results:
- **packed**: samples concatenated without padding, position ids restarting per sample. transformers isolates the
  samples from the position ids; with a varlen kernel (flash-attention) that costs nothing, but without one (SDPA,
  eager) it builds a block-diagonal mask over the whole row: O(L²) work across unrelated samples.
- **padded**: right-padded rows of samples of similar lengths (sorted, so pads are few); attention is O(B·S²). The
  responses of a GRPO group share their prompt: each distinct prompt runs once, and its KV cache and hidden states
  serve all its responses (the backward sums their gradients into it), which spares the prompt's work n-1 times.
`auto` takes packed where the model runs a flash-attention kernel and padded elsewhere.

Only response tokens are scored, and never through a `[tokens, vocab]` logits tensor of the whole micro-batch: the LM
head runs on the response positions alone, chunked (`head_logprobs`). Values are aligned with the response tokens by
`padding.response_from_packed` / `response_from_padded` — one alignment rule for old, reference and current log-probs.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lorarl.padding import packed_position_ids, response_from_packed, response_from_padded
from lorarl.trainer import routing
from lorarl.trainer.head_logprobs import head_logprobs, head_replaced
from lorarl.trainer.recompute import read_only_prefix

LAYOUTS = ("auto", "packed", "padded")
# config attributes of models that transform the logits after the LM head: those are scored from their full logits
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")  # fmt: skip


@dataclass
class SharedPrompts:
    """The distinct prompts of a micro-batch, run once ahead of the responses."""

    inputs: dict[str, Tensor]  # model keyword arguments: [U, P] left-padded
    which: Tensor  # [B]: each sample's prompt among the U


@dataclass
class MicroBatch:
    """One forward's model inputs, and where its response tokens are."""

    inputs: dict[str, Tensor]  # model keyword arguments (with `prompts`: the responses alone, after them)
    align: Callable[[Tensor], Tensor]  # per-position values [1 or B, S, ...] -> response-aligned [B, R, ...]
    targets: Tensor  # [B, R] response tokens (0 past each response)
    mask: Tensor  # [B, R] bool: a response token
    prompts: SharedPrompts | None = None
    routes: list[routing.Plan] | None = None  # a mixture's recorded routes, one plan per model call (prompts first)

    def per_token(self, calls: list[Tensor]) -> Tensor:
        """Values of each model call (`[N, S, ...]`, in the order of the calls) aligned with the response tokens:
        `[B, R, ...]`, each at the position that predicts its token."""
        values = calls[-1] if self.prompts is None else torch.cat([calls[0].index_select(0, self.prompts.which),
                                                                   calls[1]], 1)  # fmt: skip
        return self.align(values)


def resolve_layout(layout: str, model: nn.Module) -> str:
    """`auto`: packed with a flash-attention (varlen) kernel, padded otherwise."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout != "auto":
        return layout
    kernel = str(getattr(model.config, "_attn_implementation", None) or "")
    return "packed" if "flash" in kernel else "padded"


def micro_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    response_width: int,
    device,
    layout: str,
    *,
    share_prompts: bool = False,
    routes: Sequence[Tensor] | None = None,
    replay: bool = False,
) -> MicroBatch:
    """The samples (prompt + response each) as one forward's inputs in `layout` (packed or padded). `share_prompts`
    (padded): each distinct prompt is run once ahead of the responses — two forwards, whether prompts repeat or not
    (data-parallel ranks must make the same calls). `routes` (a mixture's): each sample's experts `[tokens, layers,
    k]` (-1: the router's own choice), laid out as the tokens are, forced where `replay`."""
    if layout not in ("packed", "padded"):
        raise ValueError(f"layout must be packed or padded, got {layout!r}")
    response_lens = torch.tensor([len(r) for r in responses])
    targets = torch.zeros(len(responses), response_width, dtype=torch.long)
    for i, r in enumerate(responses):
        targets[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    mask = torch.arange(response_width)[None, :] < response_lens[:, None]
    align = {"response_lens": response_lens.to(device), "shift": 1, "max_response_len": response_width}
    if layout == "padded" and share_prompts:
        distinct = {}
        which = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        micro = _after_shared_prompts(list(distinct), which, response_lens, targets, mask, align, device)
        if routes is not None:
            micro.routes = _shared_routes(routes, [len(p) for p in distinct], which, int(response_lens.max()), device,
                                          replay)  # fmt: skip
        return micro
    lengths = torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses, strict=True)])
    tokens = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    if layout == "packed":
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(device)
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long)
        inputs = {"input_ids": ids[None].to(device), "position_ids": packed_position_ids(cu_seqlens)[None].to(device)}
        plans = None if routes is None else [routing.Plan(torch.cat(list(routes))[None].to(device), replay)]
        return MicroBatch(inputs, lambda v: response_from_packed(v[0], cu_seqlens, **align),
                          targets.to(device), mask.to(device), routes=plans)  # fmt: skip
    width = int(lengths.max())
    ids = torch.zeros(len(tokens), width, dtype=torch.long)
    attention = torch.arange(width)[None, :] < lengths[:, None]
    for i, seq in enumerate(tokens):
        ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    attention = attention.to(device)
    inputs = {"input_ids": ids.to(device), "attention_mask": attention.long()}
    plans = None if routes is None else [routing.Plan(_rows(list(routes), width, device), replay)]
    return MicroBatch(inputs, lambda v: response_from_padded(v, attention, **align), targets.to(device),
                      mask.to(device), routes=plans)  # fmt: skip


def _rows(values: list[Tensor], width: int, device, *, left: bool = False) -> Tensor:
    """`[len(values), width, ...]`: each of `values` (`[n_i, ...]`) in a row of its own, at its start (or end, with
    `left` padding), -1 elsewhere (one scatter, not a copy per row)."""
    lengths = torch.tensor([len(v) for v in values])
    rows = torch.repeat_interleave(torch.arange(len(values)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    columns = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)
    if left:
        columns += torch.repeat_interleave(width - lengths, lengths)
    out = torch.full((len(values), width, *values[0].shape[1:]), -1, dtype=values[0].dtype)
    out[rows, columns] = torch.cat(values)
    return out.to(device)


def _shared_routes(routes: Sequence[Tensor], prompt_lens: list[int], which: list[int], response_width: int, device,
                   replay: bool) -> list[routing.Plan]:  # fmt: skip
    """The plans of a shared-prompt micro-batch: each distinct prompt routed as its first sample's was (left-padded),
    then every sample's response (right-padded)."""
    first = {}
    for i, u in enumerate(which):
        first.setdefault(u, i)
    prompts = [routes[first[u]][:length] for u, length in enumerate(prompt_lens)]
    responses = [route[prompt_lens[u] :] for route, u in zip(routes, which, strict=True)]
    return [routing.Plan(_rows(prompts, max(prompt_lens), device, left=True), replay),
            routing.Plan(_rows(responses, max(1, response_width), device), replay)]  # fmt: skip


def _after_shared_prompts(distinct: list[tuple[int, ...]], which: list[int], response_lens, targets, mask, align,
                          device) -> MicroBatch:  # fmt: skip
    """Left-padded distinct prompts, then right-padded responses continuing each (positions and attention mask over
    prompt + response); the hidden states are aligned over the two stages concatenated."""
    prompt_lens = torch.tensor([len(p) for p in distinct])
    width = int(prompt_lens.max())
    prompt_mask = torch.arange(width)[None, :] >= (width - prompt_lens)[:, None]
    prompt_ids = torch.zeros(len(distinct), width, dtype=torch.long)
    for i, p in enumerate(distinct):
        prompt_ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
    index = torch.tensor(which)
    response_width = max(1, int(response_lens.max()))
    response_mask = torch.arange(response_width)[None, :] < response_lens[:, None]
    response_ids = targets[:, :response_width].clone()
    full_mask = torch.cat([prompt_mask[index], response_mask], 1).to(device)
    prompts = SharedPrompts({"input_ids": prompt_ids.to(device), "attention_mask": prompt_mask.long().to(device),
                             "position_ids": (prompt_mask.long().cumsum(1) - 1).clamp(min=0).to(device)},
                            index.to(device))  # fmt: skip
    inputs = {
        "input_ids": response_ids.to(device),
        "attention_mask": full_mask.long(),
        "position_ids": (prompt_lens[index][:, None] + torch.arange(response_width)[None, :]).to(device),
    }
    return MicroBatch(inputs, lambda v: response_from_padded(v, full_mask, **align), targets.to(device),
                      mask.to(device), prompts)  # fmt: skip


def micro_batches(lengths: Sequence[int], max_tokens: int, layout: str = "packed") -> list[list[int]]:
    """Sample indices grouped into the fewest micro-batches within `max_tokens` (a longer sample goes alone), as even
    as they can be: the activations' memory follows the largest, so 15 rows and 1 would keep almost twice what 8 and 8
    keep, for the same forwards. Packed: consecutive samples, counting their tokens. Padded: samples sorted longest
    first, counting rows x the longest (pads included), so that each micro-batch holds samples of similar lengths."""
    padded = layout == "padded"
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if padded else list(range(len(lengths)))
    fewest = len(_filled(order, lengths, max_tokens, padded))
    low, high = 1, max_tokens  # the smallest budget that still needs no more micro-batches
    while low < high:
        middle = (low + high) // 2
        if len(_filled(order, lengths, middle, padded)) <= fewest:
            high = middle
        else:
            low = middle + 1
    return _filled(order, lengths, low, padded)


def _filled(order: Sequence[int], lengths: Sequence[int], budget: int, padded: bool) -> list[list[int]]:
    """`order` cut into micro-batches, each filled up to `budget`."""
    batches, batch, tokens, widest = [], [], 0, 0
    for i in order:
        cost = (len(batch) + 1) * max(widest, lengths[i]) if padded else tokens + lengths[i]
        if batch and cost > budget:
            batches.append(batch)
            batch, tokens, widest = [], 0, 0
        batch.append(i)
        tokens += lengths[i]
        widest = max(widest, lengths[i])
    return [*batches, batch] if batch else batches


def response_logprobs(
    model: nn.Module, micro: MicroBatch, *, temperature: float = 1.0, entropy_grad: bool = True
) -> tuple[Tensor, Tensor]:
    """`[B, R]` log-probs of each response token and the policy's entropy at it (zero past each response), in fp32,
    at `temperature` (the sampling distribution). `entropy_grad=False`: the entropy is only logged (cheaper)."""
    temperature = max(temperature, 1e-6)
    head = model.get_output_embeddings()
    mask = micro.mask
    if not scores_from_hidden(model):  # a wrapped head, or logits changed after it: the full logits
        if micro.prompts is not None:
            raise ValueError("this model is scored from its full logits: build its micro-batches without share_prompts")
        with routing.active(_plan(micro, -1)):
            logits = model(**micro.inputs, use_cache=False).logits
        log_p = torch.log_softmax(micro.align(logits)[mask].float() / temperature, -1)
        values = torch.stack([log_p.gather(1, micro.targets[mask][:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)], -1)
    else:

        def score(hidden: Tensor) -> Tensor:
            logp, entropy = head_logprobs(hidden, head.weight, head.bias, micro.targets[mask],
                                          temperature=temperature, entropy_grad=entropy_grad)  # fmt: skip
            return torch.stack([logp, entropy if entropy_grad else entropy.detach()], -1)

        values = _from_response_states(model, micro, score)
    slots = _on_slots(values, mask)
    return slots[..., 0], slots[..., 1]


def response_values(model: nn.Module, micro: MicroBatch, value_head: nn.Module) -> Tensor:
    """`[B, R]` float32 values of the state before each response token (zero past each response): `value_head` on the
    hidden state that predicts the token — the same alignment as the log-probs, so V_t and log π(a_t) pair up."""
    values = _from_response_states(model, micro, lambda hidden: value_head(hidden.to(value_head.weight.dtype)))
    return _on_slots(values, micro.mask)[..., 0]


def _from_response_states(model: nn.Module, micro: MicroBatch, per_token: Callable[[Tensor], Tensor]) -> Tensor:
    """`per_token` of the last hidden states that predict the response tokens (`[Tr, hidden]` -> `[Tr, k]`), from a
    forward whose LM head runs `per_token` instead of the logits. Each distinct prompt of a shared-prompt micro-batch
    runs once: its hidden states and KV cache serve all its responses."""
    head = model.get_output_embeddings()
    prefix, cache = None, {"use_cache": False}
    if micro.prompts is not None:
        with head_replaced(head, lambda hidden: hidden), routing.active(_plan(micro, 0)):
            out = model(**micro.prompts.inputs, use_cache=True)
        which = micro.prompts.which.to(out.logits.device)
        _select_rows(out.past_key_values, which)
        read_only_prefix(out.past_key_values)  # what a checkpointed layer's replay reads again (`recompute`)
        prefix, cache = out.logits.index_select(0, which), {"past_key_values": out.past_key_values, "use_cache": True}
    scores = []

    def forward(hidden: Tensor) -> Tensor:
        full = hidden if prefix is None else torch.cat([prefix, hidden], 1)
        scores.append(per_token(micro.align(full)[micro.mask]))
        return scores[-1]  # also the model's output (FSDP hooks its backward there); a logit transform leaves ours

    with head_replaced(head, forward), routing.active(_plan(micro, -1)):
        model(**micro.inputs, **cache)
    return scores[0]


def _plan(micro: MicroBatch, call: int) -> routing.Plan | None:
    return None if micro.routes is None else micro.routes[call]


def _select_rows(cache, which: Tensor) -> None:
    """`cache.batch_select_indices(which)` by `index_select`, whose backward adds the gradients of a row's repeats
    in a fixed order: the advanced indexing transformers uses accumulates them in parallel on CPU, in an order that
    changes from run to run (so did the trained weights)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(0, which), layer.values.index_select(0, which)


def scores_from_hidden(model: nn.Module) -> bool:
    """Whether the log-probs come from the hidden states through the LM head's weight (a plain Linear head and no
    transform of the logits after it), chunked: what the shared-prompt micro-batches need too."""
    return type(model.get_output_embeddings()) is nn.Linear and not _transforms_logits(model)


def _on_slots(values: Tensor, mask: Tensor) -> Tensor:
    """`[Tr, k]` values of the response tokens -> `[B, R, k]` float32, zero past each response."""
    out = values.new_zeros(*mask.shape, values.shape[-1], dtype=torch.float32)
    out[mask] = values.float()
    return out


def _transforms_logits(model: nn.Module) -> bool:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return any(getattr(config, name, None) is not None for name in LOGIT_TRANSFORMS)

"""Per-token log-probs (and entropies) of responses, from a forward pass over the **packed** batch.

Samples (prompt + response) are concatenated without padding, with position ids restarting per sample: transformers
isolates the samples in attention from the position ids (with no KV cache), so no compute is spent on pads. Values
are aligned with the response tokens by `padding.response_from_packed` — the one alignment function used for old,
reference and current log-probs alike.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lorarl.padding import left_right_pad, packed_position_ids, response_from_packed, unpad


@dataclass
class Packed:
    input_ids: torch.Tensor  # [T]
    position_ids: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [B+1]
    response_lens: torch.Tensor  # [B]
    response_width: int  # R


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], response_width: int, device) -> Packed:
    batch = left_right_pad(prompts, responses, response_width=response_width)
    packed = unpad(batch.input_ids, batch.attention_mask)
    return Packed(
        packed.values.to(device),
        packed_position_ids(packed.cu_seqlens).to(device),
        packed.cu_seqlens.to(device),
        batch.response_lens.to(device),
        response_width,
    )


def micro_batches(lengths: Sequence[int], max_tokens: int) -> Iterator[list[int]]:
    """Consecutive sample indices whose total length stays within `max_tokens` (a longer sample goes alone)."""
    batch, tokens = [], 0
    for i, length in enumerate(lengths):
        if batch and tokens + length > max_tokens:
            yield batch
            batch, tokens = [], 0
        batch.append(i)
        tokens += length
    if batch:
        yield batch


def response_logprobs(
    model: nn.Module, packed: Packed, *, temperature: float = 1.0, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[B, R]` log-probs of each response token (and the policy's entropy at it), zero past each response."""
    logits = model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None], use_cache=False).logits[0]
    logits = logits.float() / max(temperature, 1e-6)
    log_probs = torch.log_softmax(logits, dim=-1)
    targets = torch.roll(packed.input_ids, -1)  # position j scores token j+1 (across samples: unused)
    token_logp = log_probs.gather(1, targets[:, None])[:, 0]
    align = {"shift": 1, "max_response_len": packed.response_width}
    logp = response_from_packed(token_logp, packed.cu_seqlens, packed.response_lens, **align)
    if not entropy:
        return logp, None
    token_entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, response_from_packed(token_entropy, packed.cu_seqlens, packed.response_lens, **align)

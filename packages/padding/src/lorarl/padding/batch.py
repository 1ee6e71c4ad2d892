"""Build a left-right padded batch from token-id lists: the layout RL trainers use for prompt + response.

Prompts are left-padded into `P` columns and responses right-padded into `R` columns, so every response
starts at column `P` and `input_ids[:, P:]` lines up with `response_mask`.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from lorarl.padding.packing import pad, segments

TokenIds = Sequence[int] | Tensor


class LeftRightBatch(NamedTuple):
    input_ids: Tensor  # [B, P + R]
    attention_mask: Tensor  # [B, P + R] bool
    response_mask: Tensor  # [B, R] bool, the same as attention_mask[:, P:]
    prompt_lens: Tensor  # [B] int64
    response_lens: Tensor  # [B] int64

    @property
    def prompt_width(self) -> int:
        """`P`: the column where every response starts."""
        return self.input_ids.shape[1] - self.response_mask.shape[1]


def _as_ids(seq: TokenIds) -> Tensor:
    """One sequence as a 1-D integer tensor; floats and bools are rejected, not truncated."""
    ids = seq if isinstance(seq, Tensor) else torch.as_tensor(list(seq), dtype=None if len(seq) else torch.int64)
    if ids.dim() != 1 or ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(
            f"each sequence must be a flat sequence of integer token ids, got {ids.dtype} {tuple(ids.shape)}"
        )
    return ids


def _flatten(seqs: Sequence[TokenIds], name: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """All token ids of `seqs` in one flat tensor, and each sequence's length."""
    try:
        parts = [_as_ids(s).to(dtype) for s in seqs]
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"{name} must be a list of token-id sequences (lists of ints or 1-D int tensors): {e}"
        ) from None
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)), lengths


def left_right_pad(
    prompts: Sequence[TokenIds],
    responses: Sequence[TokenIds],
    *,
    pad_value: int = 0,
    prompt_width: int | None = None,
    response_width: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.int64,
) -> LeftRightBatch:
    """Prompts left-padded into `prompt_width` columns, responses right-padded into `response_width` columns.

    Widths default to the longest prompt / response; a sequence longer than its width raises (no truncation).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"prompts and responses must have the same length, got {len(prompts)} and {len(responses)}")
    prompt_ids, prompt_lens = _flatten(prompts, "prompts", dtype)
    response_ids, response_lens = _flatten(responses, "responses", dtype)
    batch = len(prompts)
    width_p = _width(prompt_width, prompt_lens, "prompt_width")
    width_r = _width(response_width, response_lens, "response_width")
    seqlen = width_p + width_r
    sample_p, rank_p = segments(prompt_lens)
    sample_r, rank_r = segments(response_lens)
    column_p = width_p - prompt_lens[sample_p] + rank_p
    column_r = width_p + rank_r
    indices = torch.cat([sample_p * seqlen + column_p, sample_r * seqlen + column_r])
    tokens = torch.cat([prompt_ids, response_ids])
    input_ids = pad(tokens, indices, batch, seqlen, pad_value)
    attention_mask = pad(torch.ones_like(tokens, dtype=torch.bool), indices, batch, seqlen, False)
    return LeftRightBatch(
        input_ids.to(device),
        attention_mask.to(device),
        attention_mask[:, width_p:].to(device),
        prompt_lens.to(device),
        response_lens.to(device),
    )


def _width(width: int | None, lengths: Tensor, name: str) -> int:
    longest = int(lengths.max()) if lengths.numel() else 0
    if width is None:
        return longest
    if width < longest:
        raise ValueError(f"{name}={width} is shorter than the longest sequence ({longest}); lorarl never truncates")
    return width

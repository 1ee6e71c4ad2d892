"""Padded `[B, S, ...]` ↔ `torch.nested` jagged tensors (`[B, j, ...]`, layout `torch.jagged`)."""

import torch
from torch import Tensor

from lorarl.padding.packing import pad, segments, unpad


def to_nested(x: Tensor, attention_mask: Tensor) -> Tensor:
    """A jagged nested tensor holding each sample's real tokens of `x` (`[B, S, ...]`), any padding layout."""
    packed = unpad(x, attention_mask)
    return torch.nested.nested_tensor_from_jagged(
        packed.values, offsets=packed.cu_seqlens.to(torch.int64), max_seqlen=packed.max_seqlen
    )


def from_nested(
    nt: Tensor, *, side: str = "right", pad_value: float = 0, seqlen: int | None = None
) -> tuple[Tensor, Tensor]:
    """Pad a jagged nested tensor to `[B, S, ...]` on `side` ("left" or "right"); returns `(padded, mask)`.

    `S` is `seqlen` when given (it must hold the longest sample), else the longest sample.
    Nested tensors with holes (non-contiguous, `nt.lengths()` set) are supported.
    """
    if not isinstance(nt, Tensor) or not nt.is_nested or nt.layout != torch.jagged:
        raise ValueError("nt must be a nested tensor with layout torch.jagged")
    if nt._ragged_idx != 1:
        raise ValueError(f"nt must be ragged in dim 1 ([B, j, ...]), got ragged dim {nt._ragged_idx}")
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    offsets = nt.offsets()
    lengths = nt.lengths() if nt.lengths() is not None else offsets.diff()
    lengths = lengths.to(torch.int64)
    batch = lengths.numel()
    longest = int(lengths.max()) if batch else 0
    if seqlen is None:
        seqlen = longest
    elif seqlen < longest:
        raise ValueError(f"seqlen={seqlen} is shorter than the longest sample ({longest})")
    sample, rank = segments(lengths)
    starts_in_values = offsets[:-1].to(torch.int64)[sample]
    column = rank if side == "right" else rank + (seqlen - lengths)[sample]
    values = nt.values().index_select(0, starts_in_values + rank)
    padded = pad(values, sample * seqlen + column, batch, seqlen, pad_value)
    positions = torch.arange(seqlen, device=offsets.device)
    if side == "right":
        mask = positions[None, :] < lengths[:, None]
    else:
        mask = positions[None, :] >= (seqlen - lengths)[:, None]
    return padded, mask

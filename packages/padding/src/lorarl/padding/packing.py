"""Padded `[B, S, ...]` ↔ packed `[T, ...]` (flash-attn varlen layout: `cu_seqlens`, `position_ids`).

Packing drops pad tokens so a forward pass spends no compute on them. Works for any padding layout:
a sample's tokens are the positions where its mask is set, in order.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from lorarl.padding._checks import as_bool_mask, check_batch_tensor


class Packed(NamedTuple):
    """A packed batch: `values[cu_seqlens[i]:cu_seqlens[i+1]]` are sample i's tokens."""

    values: Tensor  # [T, ...] the real tokens, sample by sample, in order
    indices: Tensor  # [T] int64 flat positions of those tokens in the padded B*S grid
    cu_seqlens: Tensor  # [B+1] int32 cumulative sequence lengths, starting at 0
    max_seqlen: int  # longest sample


def token_positions(attention_mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """`(indices, cu_seqlens, max_seqlen)` of the tokens a `[B, S]` mask selects, without touching any values."""
    mask = as_bool_mask(attention_mask)
    lengths = mask.sum(dim=1, dtype=torch.int32)
    cu_seqlens = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    torch.cumsum(lengths, dim=0, out=cu_seqlens[1:])
    indices = mask.flatten().nonzero().flatten()
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    return indices, cu_seqlens, max_seqlen


def unpad(x: Tensor, attention_mask: Tensor) -> Packed:
    """Drop the pad positions of `x` (`[B, S, ...]`): the packed values, their positions and `cu_seqlens`."""
    mask = as_bool_mask(attention_mask)
    check_batch_tensor(x, mask)
    indices, cu_seqlens, max_seqlen = token_positions(mask)
    values = x.flatten(0, 1).index_select(0, indices)
    return Packed(values, indices, cu_seqlens, max_seqlen)


def pad(values: Tensor, indices: Tensor, batch: int, seqlen: int, pad_value: float = 0) -> Tensor:
    """Inverse of `unpad`: scatter packed `values` (`[T, ...]`) to `indices` of a `[batch, seqlen, ...]` grid."""
    if not isinstance(values, Tensor) or values.dim() < 1:
        raise ValueError("values must be a tensor of shape [T, ...]")
    if not isinstance(indices, Tensor) or indices.dim() != 1 or indices.shape[0] != values.shape[0]:
        got = tuple(indices.shape) if isinstance(indices, Tensor) else type(indices).__name__
        raise ValueError(f"indices must have shape [T] = [{values.shape[0]}] (one per value), got {got}")
    if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
        raise ValueError(f"indices must hold integers, got dtype {indices.dtype}")
    if batch < 0 or seqlen < 0:
        raise ValueError(f"batch and seqlen must be non-negative, got batch={batch}, seqlen={seqlen}")
    if indices.numel():
        if indices.min() < 0 or indices.max() >= batch * seqlen:
            raise ValueError(f"indices must lie in [0, batch*seqlen) = [0, {batch * seqlen})")
        if torch.unique(indices).numel() != indices.numel():
            raise ValueError("indices must not repeat a position")
    out = values.new_full((batch * seqlen, *values.shape[1:]), pad_value)
    out[indices.to(device=values.device, dtype=torch.int64)] = values
    return out.view(batch, seqlen, *values.shape[1:])


def segments(lengths: Tensor) -> tuple[Tensor, Tensor]:
    """For consecutive segments of `lengths` (`[B]`): each element's segment index and position in it (`[T]` each)."""
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum())
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=total)
    first = torch.cumsum(lengths, 0) - lengths
    return segment, torch.arange(total, device=lengths.device) - first[segment]


def packed_position_ids(cu_seqlens: Tensor) -> Tensor:
    """`[T]` int64 position of each packed token within its own sample (restarting at 0 per sample)."""
    return segments(cu_seqlens.diff())[1]

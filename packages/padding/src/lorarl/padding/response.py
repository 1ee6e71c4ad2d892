"""Response-aligned extraction of per-token values (log-probs, entropies, values) from a forward pass.

One alignment rule serves every layout, so old, reference and current log-probs can never disagree:
sample i's tokens (prompt then response, length L) are `seq`; with `r = response_lens[i]`,
`out[i, k] = seq[L - r - shift + k]` for `k < r`, `pad_value` after.
`shift=1`: the value at position j scores token j+1 (log-probs from logits); `shift=0`: values already aligned.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from lorarl.padding._checks import as_bool_mask, as_lengths, check_batch_tensor, check_cu_seqlens
from lorarl.padding.packing import token_positions


def _response_rows(
    cu_seqlens: Tensor, response_lens: Tensor | Sequence[int], shift: int, max_response_len: int | None
) -> tuple[Tensor, Tensor]:
    """`(rows, slots)`: packed row of every response value, and the `[B, R]` bool mask of the slots they fill."""
    if not isinstance(shift, int) or shift < 0:
        raise ValueError(f"shift must be a non-negative int, got {shift!r}")
    cu = cu_seqlens.to(torch.int64)
    batch = cu.numel() - 1
    seq_lens = cu.diff()
    r = as_lengths(response_lens, batch, cu.device, "response_lens")
    too_long = (r > 0) & (r + shift > seq_lens)
    if too_long.any():
        i = int(too_long.nonzero()[0])
        raise ValueError(
            f"response_lens[{i}]={int(r[i])} does not fit sample {i} of {int(seq_lens[i])} tokens with shift={shift} "
            f"(a non-empty response needs response_len + shift <= sample length)"
        )
    longest = int(r.max()) if batch else 0
    if max_response_len is None:
        max_response_len = longest
    elif max_response_len < longest:
        raise ValueError(f"max_response_len={max_response_len} is shorter than the longest response ({longest})")
    slot = torch.arange(max_response_len, device=cu.device)
    slots = slot[None, :] < r[:, None]
    first_row = cu[1:] - r - shift  # packed row of the value for response token 0
    rows = (first_row[:, None] + slot[None, :])[slots]
    return rows, slots


def _scatter_to_slots(source: Tensor, rows: Tensor, slots: Tensor, pad_value: float) -> Tensor:
    out = source.new_full((*slots.shape, *source.shape[1:]), pad_value)
    out[slots] = source.index_select(0, rows)
    return out


def response_from_packed(
    values: Tensor,
    cu_seqlens: Tensor,
    response_lens: Tensor | Sequence[int],
    *,
    shift: int = 1,
    max_response_len: int | None = None,
    pad_value: float = 0,
) -> Tensor:
    """Per-response-token values `[B, R, ...]` from packed `values` (`[T, ...]`, samples delimited by `cu_seqlens`)."""
    if not isinstance(values, Tensor) or values.dim() < 1:
        raise ValueError("values must be a tensor of shape [T, ...]")
    check_cu_seqlens(cu_seqlens, values.shape[0])
    rows, slots = _response_rows(cu_seqlens.to(values.device), response_lens, shift, max_response_len)
    return _scatter_to_slots(values, rows, slots, pad_value)


def response_from_padded(
    values: Tensor,
    attention_mask: Tensor,
    response_lens: Tensor | Sequence[int],
    *,
    shift: int = 1,
    max_response_len: int | None = None,
    pad_value: float = 0,
) -> Tensor:
    """Per-response-token values `[B, R, ...]` from a padded forward (`[B, S, ...]`) in any layout.

    A sample's tokens are the positions where `attention_mask` is set, in order: left-, right-,
    left-right-padded and gapped batches all work. Only the response values are gathered.
    """
    mask = as_bool_mask(attention_mask)
    check_batch_tensor(values, mask, name="values")
    indices, cu_seqlens, _ = token_positions(mask)
    rows, slots = _response_rows(cu_seqlens, response_lens, shift, max_response_len)
    return _scatter_to_slots(values.flatten(0, 1), indices[rows], slots, pad_value)

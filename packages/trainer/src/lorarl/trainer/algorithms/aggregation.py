"""The one loss aggregation: per-token values `[N, R]` to a scalar, by `algorithm.loss_agg_mode`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def checked_output(entry, kind: str, value, shape: tuple[int, ...], what: str) -> Tensor:
    """`value`, what the registered `entry` (a `kind`: estimator, policy loss…) returned as `what`, if it is a
    floating-point or boolean tensor of `shape`; else a `TrainerError` naming the piece by where it comes from, what
    it returned and what was expected — not a traceback from deep inside the step."""
    import torch

    from lorarl.trainer.errors import TrainerError

    if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shape) and not value.is_complex() and (
            value.is_floating_point() or value.dtype == torch.bool):  # fmt: skip
        return value
    got = (f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
           if isinstance(value, torch.Tensor) else f"{type(value).__name__} {value!r:.60}")  # fmt: skip
    raise TrainerError(
        f"{kind} {entry.name} ({entry.origin}) returned {got} as {what}; expected a float tensor of "
        f"shape {tuple(shape)} (responses x response tokens)"
    )


AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check_shapes(reference: str, **tensors: Tensor | None) -> None:
    """Per-token inputs must all have the shape of `reference` (the first one named): `[N, R]`."""
    shape = tuple(tensors[reference].shape)
    if len(shape) != 2:
        raise ValueError(f"{reference} must be [N, R], got shape {shape}")
    for name, tensor in tensors.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have the shape of {reference} {shape} ([N, R]), got {tuple(tensor.shape)}")


def aggregate(
    values: Tensor,
    response_mask: Tensor,
    mode: str,
    *,
    norm_len: int | None = None,
    total_tokens: float | None = None,
    total_sequences: float | None = None,
) -> Tensor:
    """One scalar from per-token values `[N, R]`.

    token-mean: Σ over valid tokens / their count. token-sum: Σ over valid tokens. seq-mean-token-sum: per-sequence
    sums, averaged over sequences. seq-mean-token-mean: per-sequence means, averaged. seq-mean-token-sum-norm:
    per-sequence sums / `norm_len` (default R), averaged (Dr. GRPO). `total_tokens` / `total_sequences` replace this
    batch's counts as the denominators, so that the sum over micro-batches equals the value of the whole batch.

    The seq-mean modes average over the sequences with at least one valid token, as verl does: a response masked out
    whole (`mask_truncated`) is left out of training, and counting it would instead scale every other response's
    gradient down by the share of truncated ones — a learning rate that falls as responses grow long.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode must be one of {AGG_MODES}, got {mode!r}")
    check_shapes("response_mask", response_mask=response_mask, values=values)
    mask = response_mask.to(values.dtype)
    masked = values * mask
    sequences = total_sequences if total_sequences is not None else float(response_mask.any(1).sum())
    if mode == "token-mean":
        tokens = total_tokens if total_tokens is not None else mask.sum().clamp(min=1)
        return masked.sum() / tokens
    if mode == "token-sum":
        return masked.sum()
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(sequences, 1)
    if mode == "seq-mean-token-mean":
        per_sequence = masked.sum(1) / mask.sum(1).clamp(min=1)
        return per_sequence.sum() / max(sequences, 1)
    return masked.sum() / (norm_len if norm_len is not None else values.shape[1]) / max(sequences, 1)

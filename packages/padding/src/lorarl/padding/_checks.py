"""Input validation shared by the padding functions: bad input raises, naming the argument, never a wrong result."""

from collections.abc import Sequence

import torch
from torch import Tensor


def as_bool_mask(mask: Tensor, name: str = "attention_mask") -> Tensor:
    """A `[B, S]` mask as bool; accepts bool, integer or floating masks holding only 0 and 1."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [B, S], got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"{name} must have shape [B, S], got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"{name} must be bool or hold only 0/1, got dtype {mask.dtype}")
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError(f"{name} must hold only 0 and 1 (or be bool); got other values (dtype {mask.dtype})")
    return mask != 0


def check_batch_tensor(x: Tensor, mask: Tensor, name: str = "x", mask_name: str = "attention_mask") -> None:
    """`x` must be `[B, S, ...]` matching a `[B, S]` mask, on the same device."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [B, S, ...], got {type(x).__name__}")
    if x.dim() < 2 or x.shape[:2] != mask.shape:
        raise ValueError(
            f"{name} must have shape [B, S, ...] matching {mask_name} {tuple(mask.shape)}, got {tuple(x.shape)}"
        )
    if x.device != mask.device:
        raise ValueError(f"{name} is on {x.device} but {mask_name} is on {mask.device}; put them on one device")


def as_lengths(lengths: Tensor | Sequence[int], batch: int, device: torch.device, name: str) -> Tensor:
    """Per-sample lengths as an int64 `[B]` tensor on `device`; non-negative integers only."""
    if isinstance(lengths, Tensor):
        if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
            raise ValueError(f"{name} must hold integers, got dtype {lengths.dtype}")
        t = lengths.to(device=device, dtype=torch.int64)
    else:
        try:
            t = torch.as_tensor(list(lengths), dtype=torch.int64, device=device)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{name} must be a sequence of {batch} integers: {e}") from None
    if t.shape != (batch,):
        raise ValueError(f"{name} must have shape [B] = [{batch}], got {tuple(t.shape)}")
    if (t < 0).any():
        raise ValueError(f"{name} must be non-negative, got {t.tolist()}")
    return t


def check_cu_seqlens(cu_seqlens: Tensor, total: int, name: str = "cu_seqlens") -> None:
    """`[B+1]` integer offsets: start at 0, never decrease, end at the number of packed tokens."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [B+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must have shape [B+1], got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype == torch.bool or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise ValueError(f"{name} must hold integers, got dtype {cu_seqlens.dtype}")
    if cu_seqlens[0] != 0 or (cu_seqlens.diff() < 0).any() or cu_seqlens[-1] != total:
        raise ValueError(
            f"{name} must start at 0, never decrease and end at the number of packed tokens ({total}); "
            f"got {cu_seqlens.tolist()}"
        )

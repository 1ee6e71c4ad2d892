"""The readable reference backend: fp32 `addmm` on row tiles, so no full-size temporary and one rounding."""

import torch

TILE_BYTES = 8 << 20  # fp32 bytes per row tile


def merge(weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """`out = weight + scale * left @ right`, tile by tile in fp32, rounded once into `out`."""
    right32 = right.to(torch.float32)
    rows = max(1, TILE_BYTES // (4 * max(1, weight.shape[1])))
    for start in range(0, weight.shape[0], rows):
        tile = weight[start : start + rows].to(torch.float32, copy=True)
        tile.addmm_(left[start : start + rows].to(torch.float32), right32, alpha=scale)
        out[start : start + rows].copy_(tile)

"""The readable reference backend: fp32 `addmm` on row tiles, so no full-size temporary and one rounding."""

import torch

TILE_BYTES = 8 << 20  # fp32 bytes per row tile


def merge(weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """`out[e] = weight[e] + scale * left[e] @ right[e]` for each expert e of the 3-D tensors (a dense merge is a group
    of one), tile by tile in fp32, rounded once into `out`."""
    rows = max(1, TILE_BYTES // (4 * max(1, weight.shape[2])))
    for expert in range(weight.shape[0]):
        right32 = right[expert].to(torch.float32)
        for start in range(0, weight.shape[1], rows):
            tile = weight[expert, start : start + rows].to(torch.float32, copy=True)
            tile.addmm_(left[expert, start : start + rows].to(torch.float32), right32, alpha=scale)
            out[expert, start : start + rows].copy_(tile)

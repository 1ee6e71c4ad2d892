"""The factor sync (`rollout.sync=factors`): only the LoRA factors cross the wire, and the engine merges them.

Each version carries, for every adapted layer, `lora_A`, `lora_B`, the scale and the layout (a *factor set*,
`r·(in+out)` values per layer instead of `in·out`; for a mixture's fused experts `[E, r, in]` and `[E, out, r]`,
merged expert by expert in one call of the grouped op); the first one also carries the base weights `W0` the factors
add to, which the engine keeps pristine (`FactorMerger`) and merges out of place, `W = W0 + s·B@A`, with
`lorarl.lora_merge.merge_factors` — the kernel and rounding of the trainer's merged sync, so the engine ends up with the
very bits a merged sync would give it, and `W0` never drifts.

A factor set is named tensors, as full weights are — so every channel that carries weights carries it, checksummed and
versioned alike (a sync group, CUDA IPC buckets, an in-process handover): for each adapted weight `<weight>.lora_A`,
`<weight>.lora_B`, `<weight>.lora_scale` (the scale, a 0-d float64: exact) and, for a transposed layout (GPT-2's
Conv1D, embeddings), `<weight>.lora_fan_in_fan_out` (a 0-d bool); any other name is a base weight.

The merge needs `lorarl-lora-merge` beside the engine (`pip install lorarl-weight-sync[factors]`); this module imports
it only when a factor set is merged.
"""

from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch

_A, _B, _SCALE, _TRANSPOSED = ".lora_A", ".lora_B", ".lora_scale", ".lora_fan_in_fan_out"


class Factors(NamedTuple):
    """What a LoRA layer adds to its base weight: `scale · lora_B @ lora_A` (transposed when `fan_in_fan_out`);
    the fields of `lorarl.lora_merge.LoraFactors`."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scale: float
    fan_in_fan_out: bool


def factor_set(factors: Mapping[str, tuple], base: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The named tensors to send for `factors` (base-weight name -> `(lora_A, lora_B, scale, fan_in_fan_out)`, as
    `lora_merge.lora_factors` returns them) and, when the engine does not hold them yet, the `base` weights."""
    tensors: dict[str, torch.Tensor] = {}
    for name, (lora_A, lora_B, scale, fan_in_fan_out) in factors.items():
        tensors[name + _A], tensors[name + _B] = lora_A.contiguous(), lora_B.contiguous()  # experts' B: a strided view
        tensors[name + _SCALE] = torch.tensor(float(scale), dtype=torch.float64)
        if fan_in_fan_out:
            tensors[name + _TRANSPOSED] = torch.tensor(True)
    tensors.update(base or {})
    return tensors


def read_factor_set(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, Factors], dict[str, torch.Tensor]]:
    """`factor_set`'s inverse: `(factors, base)`. Raises `ValueError` naming what does not fit the format."""
    adapted = [name.removesuffix(_SCALE) for name in tensors if name.endswith(_SCALE)]
    factors = {}
    for name in adapted:
        missing = [name + s for s in (_A, _B) if name + s not in tensors]
        if missing:
            raise ValueError(f"the factor set lacks {missing}")
        transposed = tensors.get(name + _TRANSPOSED)
        factors[name] = Factors(tensors[name + _A], tensors[name + _B], float(tensors[name + _SCALE]),
                                bool(transposed) if transposed is not None else False)  # fmt: skip
    parts = {name + s for name in adapted for s in (_A, _B, _SCALE, _TRANSPOSED)}
    strays = [name for name in tensors if name not in parts and name.endswith((_A, _B, _TRANSPOSED))]
    if strays:
        raise ValueError(f"the factor set has factors without a scale: {strays[:5]}")
    return factors, {name: t for name, t in tensors.items() if name not in parts}


def narrowed_base(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A factor set with its base weights `narrowed` to the engine's `dtype`: what a sender does before a wire, so
    that the first set crosses in half the bytes and the engine never holds the wider copy."""
    _, base = read_factor_set(tensors)
    return {name: narrowed(t, dtype) if name in base else t for name, t in tensors.items()}


class FactorMerger:
    """An engine's pristine base weights and the merge of each factor set into serving weights.

    `store` keeps the base weights a factor set brings — each in `dtype` (the engine's) when that holds it exactly
    (a bf16 checkpoint trained in fp32: half the memory, the same bits merged; `narrowed`), else as sent; never
    written to after.
    `merged` checks a whole factor set against them when called, before any merge, so a set that does not fit
    changes nothing."""

    def __init__(self, dtype: torch.dtype, *, backend: str = "auto"):
        self.dtype, self.backend = dtype, backend
        self.base: dict[str, torch.Tensor] = {}

    def store(self, base: Mapping[str, torch.Tensor], *, share: bool = False) -> None:
        """Keep `base` as the pristine base weights; `share`: hold the tensors themselves (the trainer's frozen base,
        in the trainer's process: no copy at all)."""
        for name, tensor in base.items():
            self.base[name] = tensor if share else narrowed(tensor, self.dtype)

    def _check(self, factors: Mapping[str, Factors]) -> None:
        """Raise `ValueError` naming the first layer whose factors do not fit its base weight (or that has none)."""
        for name, f in factors.items():
            if name not in self.base:
                raise ValueError(f"no base weight for {name!r}: the first factor set must carry it (none stored yet"
                                 f"{'' if self.base else ' at all'})")  # fmt: skip
            experts, (rows, cols) = self.base[name].shape[:-2], self.base[name].shape[-2:]  # experts: [E, rows, cols]
            fan_in, fan_out = (rows, cols) if f.fan_in_fan_out else (cols, rows)
            rank = f.lora_A.shape[-2] if f.lora_A.dim() >= 2 else -1
            if f.lora_A.shape != (*experts, rank, fan_in) or f.lora_B.shape != (*experts, fan_out, rank):
                raise ValueError(f"{name}: factors {tuple(f.lora_A.shape)} and {tuple(f.lora_B.shape)} do not fit its "
                                 f"base weight {tuple(self.base[name].shape)}")  # fmt: skip

    def merged(
        self, factors: Mapping[str, Factors], *, outputs: Mapping[str, torch.Tensor] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stored base weight in the engine's dtype, in the order stored: `W0 + s·B@A` for those `factors`
        adapts, merged into `outputs[name]` when given (e.g. the engine's own parameter) or a new tensor; `W0` for
        the others (unadapted parts of a fused engine layer, loaded with it). The whole set is checked here, at the
        call (raising `ValueError` naming what does not fit); the merges happen as the result is iterated."""
        self._check(factors)
        return self._merging(factors, outputs or {})

    def _merging(
        self, factors: Mapping[str, Factors], outputs: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        from lorarl.lora_merge import merge_factors

        for name, weight in self.base.items():
            f = factors.get(name)
            if f is None:
                yield name, weight.to(self.dtype)
                continue
            out = outputs.get(name)
            if out is None:
                out = torch.empty(weight.shape, dtype=self.dtype, device=weight.device)
            on_device = f._replace(lora_A=f.lora_A.to(weight.device), lora_B=f.lora_B.to(weight.device))
            yield name, merge_factors(weight, on_device, out=out, backend=self.backend)


def narrowed(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype` if that holds it exactly, else as it is (the merge reads either as the same fp32)."""
    if tensor.dtype == dtype or not (tensor.is_floating_point() and dtype.itemsize < tensor.dtype.itemsize):
        return tensor
    narrow = tensor.to(dtype)
    return narrow if torch.equal(narrow.to(tensor.dtype), tensor) else tensor

"""A weight transfer without a wire: named tensors copied into a module of the same process (an engine that lives in
the trainer's process), with the receiver's guarantees — the manifest is checked against the module before anything
is applied, and a stream that then breaks its manifest raises `PartialLoadError` naming what was applied."""

import time
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from lorarl.weight_sync.protocol import TensorSpec
from lorarl.weight_sync.receiver import PartialLoadError, _mismatches
from lorarl.weight_sync.sender import SyncStats


def copy_into(
    module: nn.Module,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    manifest: Sequence[TensorSpec | tuple],
    strict: bool = True,
) -> SyncStats:
    """Copy `named_tensors` (a lazy stream such as `lora_merge.iter_merged_weights`) into the parameters and buffers
    of `module` named alike. `manifest` announces every tensor (name, shape, dtype); unknown names, shape or dtype
    mismatches — and, with `strict`, names it lacks — raise `ValueError` before anything is applied."""
    started = time.perf_counter()
    specs = [TensorSpec.coerce(spec) for spec in manifest]
    targets = dict(module.state_dict(keep_vars=True))
    problems = _mismatches(specs, targets, strict)
    if problems:
        raise ValueError(f"version {version} does not fit the target, nothing applied: " + "; ".join(problems))
    announced = {spec.name: spec for spec in specs}
    applied: list[str] = []
    nbytes = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            got = TensorSpec.of(name, tensor)
            if got != announced.get(name):
                raise PartialLoadError(f"{got} is not in the manifest as such", applied)
            targets[name].copy_(tensor)
            applied.append(name)
            nbytes += tensor.nbytes
    if len(applied) != len(specs):
        raise PartialLoadError(f"the stream ended after {len(applied)} of the {len(specs)} tensors announced", applied)
    return SyncStats(version, len(applied), nbytes, 0, time.perf_counter() - started)

"""The inline placement (`rollout.worker=inline`): the worker in the trainer's own process — no second copy of torch
and transformers, no wire: merged weights are copied from the stream straight into its model, with the receiver's
checks (`weight_sync.copy_into`); a factor set is merged from the trainer's own base weights (shared, not copied).
It generates when asked, so nothing overlaps with training."""

import time
from collections.abc import Iterable, Sequence

import torch

from lorarl.trainer.engines.base import Capabilities, Completion, GeneratesWhenAsked, SamplingParams, Worker
from lorarl.weight_sync import SyncStats, TensorSpec


class InlineEngine(GeneratesWhenAsked):
    def __init__(self, worker: Worker):
        self.worker = worker
        self.version = worker.version
        self.capabilities = Capabilities(checksum=worker.capabilities.checksum)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        return self.worker.generate([list(p) for p in prompts], sampling)

    def sync_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, manifest: Sequence[TensorSpec | tuple]
    ) -> SyncStats:
        stats = self.worker.load_weights(named_tensors, version, manifest)
        self.version = self.worker.version
        return stats

    def sync_adapter(self, tensors: dict[str, torch.Tensor], config: dict, *, version: int) -> SyncStats:
        started = time.perf_counter()
        owned = {name: tensor.detach().clone() for name, tensor in tensors.items()}  # the trainer trains its own on
        self.version = self.worker.serve_adapter(owned, config, version)
        return SyncStats(version, len(owned), sum(t.nbytes for t in owned.values()), 0, time.perf_counter() - started)

    def sync_factors(self, tensors: dict[str, torch.Tensor], *, version: int) -> SyncStats:
        started = time.perf_counter()
        self.version = self.worker.serve_factors(tensors, version, share=True)  # merged before it returns
        nbytes = sum(t.nbytes for t in tensors.values())
        return SyncStats(version, len(tensors), nbytes, 0, time.perf_counter() - started)

    def checksum(self) -> str:
        return self.worker.checksum()

    def close(self) -> None:
        self.worker.close()

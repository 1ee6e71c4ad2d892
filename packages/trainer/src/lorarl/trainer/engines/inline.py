"""The inline placement (`rollout.worker=inline`): any worker in the trainer's own process — no second copy of torch
and transformers, no wire: each update reaches the worker as it is (`Worker.apply`), its tensors the trainer's own
(merged weights copied from the stream straight into the HF model; a factor set merged from the trainer's own base
weights; vLLM's through its in-process channel). It generates when asked, so nothing overlaps with training."""

from collections.abc import Sequence

from lorarl.trainer.engines.base import Capabilities, Completion, GeneratesWhenAsked, Sampling, Worker
from lorarl.weight_sync import SyncStats, Update


class InlineEngine(GeneratesWhenAsked):
    def __init__(self, worker: Worker):
        self.worker = worker
        own = worker.capabilities
        self.capabilities = Capabilities(sleep=own.sleep, checksum=own.checksum, keeps_weights=own.keeps_weights)

    @property
    def version(self) -> int:
        return self.worker.version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        return self.worker.generate([list(p) for p in prompts], sampling)

    def sync(self, update: Update) -> SyncStats:
        return self.worker.apply(update, shared=True)

    def sleep(self) -> None:
        self.worker.sleep()

    def checksum(self) -> str:
        return self.worker.checksum()

    def close(self) -> None:
        self.worker.close()

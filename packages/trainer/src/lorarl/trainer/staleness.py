"""`rollout.max_staleness=k`: training does not wait for the slowest episode.

The batch of step i is generated from exactly the weights of step i-k (the run's first weights for the first k
steps), on engine i mod (k + 1): an engine holds one batch's weights, so k + 1 engines let batches i..i+k play at
once while the trainer trains on batch i — an environment's latency is paid once per k + 1 steps. After step i, its
engine (idle now) takes the new weights, and at step i + 1 starts batch i + 1 + k. Every completion carries its
version, checked exactly; the loss's importance correction (`algorithm.rollout_correction`) takes the rest.

A checkpoint keeps the trainable weights the batches in flight were started from, and the sampler before the first
of them: a resumed run starts them again from those weights and repeats an uninterrupted one.

`rollout.in_flight_updates` (PipelineRL's in-flight updates): every turn goes to the engine holding the newest
weights instead, so an episode takes them at its next turn; each action keeps the version that sampled it (the
batch's at the least), and the engines take turns and syncs one at a time (a lock each). Which turn meets which
weights depends on timing: such runs do not repeat exactly.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import torch
from torch import nn

from lorarl.trainer.engines import Completion, RolloutEngine
from lorarl.trainer.engines.base import Sampling
from lorarl.trainer.rollout import Rollouts, check_versions
from lorarl.trainer.weights import WeightSync


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the weights the trainer changes (a LoRA adapter's: small)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_trainable(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    parameters = dict(model.named_parameters())
    for name, tensor in state.items():
        parameters[name].copy_(tensor)


class StaleBatches:
    """The k + 1 engines and their syncs, the batches in flight (started on `rollouts`), and the trainable weights
    of each version a batch in flight was started from."""

    def __init__(self, k: int, model: nn.Module, engines: list[RolloutEngine], syncs: list[WeightSync],
                 rollouts: Rollouts, resumed: dict | None = None, *, in_flight_updates: bool = False,
                 newest: int = 0):  # fmt: skip
        self.k, self.model, self.engines, self.syncs, self.rollouts = k, model, engines, syncs, rollouts
        self.in_flight_updates, self.newest = in_flight_updates, newest  # the engine holding the newest weights
        self.locks = [threading.Lock() for _ in engines]
        self.weights: dict[int, dict[str, torch.Tensor]] = dict(resumed["weights"]) if resumed else {}
        self.resumed_versions: dict[int, int] = dict(resumed["versions"]) if resumed else {}

    def start(self, step: int, version: int, last: int) -> None:
        """Batches `step`..`step + k` (to the `last` step) in flight: each one not yet started starts on its engine
        from the weights `version` (the current ones; a resumed run's batches from the versions they had)."""
        if version not in self.weights:
            self.weights[version] = trainable_state(self.model)
        for i in range(step, min(step + self.k, last) + 1):
            if i in self.rollouts.in_flight:
                continue
            engine, sync = self.engines[i % (self.k + 1)], self.syncs[i % (self.k + 1)]
            batch_version = self.resumed_versions.pop(i, version)
            if sync.version != batch_version:  # a resumed run's batch: its engine takes the weights it had
                with self._weights_of(batch_version):
                    sync.sync(version=batch_version)
            if self.in_flight_updates:
                self.rollouts.start(i, NewestEngine(self), batch_version, newer=True)
            else:
                self.rollouts.start(i, engine, batch_version)
        in_use = {batch.version for batch in self.rollouts.in_flight.values()} | {version}
        self.weights = {v: w for v, w in self.weights.items() if v in in_use}

    def sync(self, step: int):
        """The weights of `step` into the engine whose batch `step` has ended, which then holds the newest."""
        index = step % (self.k + 1)
        with self.locks[index]:
            stats = self.syncs[index].sync(version=step)
        self.newest = index
        return stats

    def newest_engine(self) -> tuple[RolloutEngine, WeightSync]:
        return self.engines[self.newest], self.syncs[self.newest]

    def state(self) -> dict:
        """What a checkpoint keeps: each batch in flight's version, and those versions' trainable weights."""
        versions = {step: batch.version for step, batch in self.rollouts.in_flight.items()}
        return {"versions": versions, "weights": {v: self.weights[v] for v in set(versions.values())}}

    @contextlib.contextmanager
    def _weights_of(self, version: int):
        now = trainable_state(self.model)
        load_trainable(self.model, self.weights[version])
        try:
            yield
        finally:
            load_trainable(self.model, now)


class NewestEngine:
    """`rollout.in_flight_updates`: a batch's turns, each sampled by the engine holding the newest weights then (its
    reply checked to be of the version that engine was sent)."""

    def __init__(self, batches: StaleBatches):
        self.batches = batches

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        index = self.batches.newest
        with self.batches.locks[index]:
            completions = self.batches.engines[index].generate(prompts, sampling)
            check_versions(completions, self.batches.syncs[index].version)
        return completions

"""A weight update as a value: one version of what an engine serves, in one of the forms an engine can apply.

    weights   full weights (merged, or the base alone): loaded into the engine's model by name
    factors   a factor set (`weight_sync.factors`): the LoRA factors, merged by the engine into its weights from the
              pristine base weights it keeps (the first set carries them)
    adapter   a LoRA adapter (peft tensors and config): served unmerged on the base weights the engine holds

An update's `coverage` says what it covers: `full` — every weight of the engine's model (what a receiver checks) — or
`subset` — some of them (the layers an adapter changes, say), the others left as the engine holds them. Whatever
carries it (`weight_sync.channels`), an update is applied whole or not at all. How the trainer makes one
from its model (merged, in another dtype, only the factors…) is the trainer's business (its sync kinds); the form is
all an engine reads.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from lorarl.weight_sync.protocol import TensorSpec

FORMS = ("weights", "factors", "adapter")
COVERAGES = ("full", "subset")
NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Update:
    """Version `version` in form `form`: `tensors` (a lazy stream of `(name, tensor)`, or a mapping), `manifest`
    (what a stream will yield, so that a receiver checks the whole version before applying any of it; a mapping is
    its own), for an adapter its peft `config`, and its `coverage` (`full` or `subset` of the model's weights)."""

    form: str
    version: int
    tensors: NamedTensors
    manifest: Sequence[TensorSpec | tuple] | None = None
    config: dict | None = None
    coverage: str = "full"

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"an update's form must be one of {FORMS}, got {self.form!r}")
        if self.coverage not in COVERAGES:
            raise ValueError(f"an update's coverage must be one of {COVERAGES}, got {self.coverage!r}")
        if (self.form == "adapter") != (self.config is not None):
            raise ValueError("an adapter update carries its peft config, and only an adapter update does")
        if self.form != "weights" and not isinstance(self.tensors, Mapping):
            raise ValueError(f"a {self.form} update is a mapping of named tensors (sent whole), not a stream")

    @property
    def full(self) -> bool:
        """Whether it covers every weight (a receiver then refuses one that lacks any)."""
        return self.coverage == "full"

    def named(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The `(name, tensor)` pairs."""
        return self.tensors.items() if isinstance(self.tensors, Mapping) else self.tensors

    @property
    def specs(self) -> list[TensorSpec] | None:
        """The manifest as `TensorSpec`s (a mapping's own when none was given; None for a stream without one)."""
        if self.manifest is not None:
            return [TensorSpec.coerce(spec) for spec in self.manifest]
        if isinstance(self.tensors, Mapping):
            return [TensorSpec.of(name, tensor) for name, tensor in self.tensors.items()]
        return None

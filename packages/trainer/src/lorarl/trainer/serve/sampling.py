"""Sampling for the server: sampler snapshots (adapters frozen at `save_weights_for_sampler`) held as adapters on the
shared base, and the HF engine's decode loop run with one snapshot active, ending responses at end-of-sequence, at
stop token ids or at stop strings. The snapshots stay in memory: a run's new sampler weights never touch the disk."""

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from lorarl.trainer.decode import StopStrings, decode
from lorarl.trainer.engines.hf import stop_candidates
from lorarl.trainer.serve.tenancy import LoraShape, RequestError, SharedBase


@dataclass(frozen=True)
class SampleRequest:
    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (end-of-sequence, a stop token or string: kept in `tokens`) or "length"


@dataclass
class Snapshot:
    """Sampler weights: a run's adapter as it was when saved."""

    shape: LoraShape
    tensors: dict[str, Tensor]


class StopTokens:
    """Ends a row of one decode call when it samples one of `ids` (kept in the response), remembering where, as
    `StopStrings` does for strings."""

    def __init__(self, ids: tuple[int, ...]):
        self.ids = torch.tensor(sorted(set(ids)), dtype=torch.long)
        self.ends: dict[int, int] = {}

    def __call__(self, history: list[Tensor], token: Tensor, ended: Tensor) -> Tensor:
        stopped = torch.isin(token, self.ids.to(token.device)) & ~ended
        for row in stopped.nonzero()[:, 0].tolist():
            self.ends[row] = len(history)
        return stopped


class EitherStop:
    """Stop tokens and stop strings together: a row ends at whichever comes first."""

    def __init__(self, *stops):
        self.stops = stops
        self.ends: dict[int, int] = {}

    def __call__(self, history: list[Tensor], token: Tensor, ended: Tensor) -> Tensor:
        stopped = torch.zeros_like(ended)
        for stop in self.stops:
            stopped |= stop(history, token, ended | stopped)
            self.ends.update(stop.ends)
        return stopped


class Sampler:
    """Samples from the shared base with a snapshot's adapter active; the most recently used snapshots stay loaded as
    adapters (`loaded` of them), the others are kept as tensors and loaded again when asked for."""

    def __init__(self, base: SharedBase, loaded: int = 8):
        self.base, self.capacity = base, loaded
        self.loaded: OrderedDict[str, None] = OrderedDict()  # snapshot path -> its adapter slot is `slot(path)`

    @staticmethod
    def slot(path: str) -> str:
        return "sampler-" + str(abs(hash(path)))

    def activate(self, path: str, snapshot: Snapshot) -> str:
        """The adapter name of `snapshot`, loaded if it is not (the least recently used one unloaded past capacity)."""
        name = self.slot(path)
        if path in self.loaded:
            self.loaded.move_to_end(path)
            return name
        self.base.add_adapter(name, snapshot.shape)
        self.base.load_adapter_tensors(name, snapshot.tensors)
        for p in self.base.factors(name).values():
            p.requires_grad_(False)
        self.loaded[path] = None
        while len(self.loaded) > self.capacity:
            old, _ = self.loaded.popitem(last=False)
            self.base.remove_adapter(self.slot(old))
        return name

    def forget(self, path: str) -> None:
        if self.loaded.pop(path, 0) is None:
            self.base.remove_adapter(self.slot(path))

    @torch.no_grad()
    def sample(self, adapter: str | None, request: SampleRequest) -> list[Sequence]:
        """`request.num_samples` responses to its prompt with `adapter` active (None: the base model)."""
        base = self.base
        tokenizer = base.tokenizer
        if not request.prompt:
            raise RequestError("prompt: expected at least one token")
        if max(request.prompt) >= base.vocab_size or min(request.prompt) < 0:
            raise RequestError(f"prompt: token ids must be in [0, {base.vocab_size}) for {base.name}")
        stops = []
        if request.stop_tokens:
            stops.append(StopTokens(request.stop_tokens))
        if request.stop_strings:
            candidates = stop_candidates(tokenizer, request.stop_strings, base.vocab_size)
            stops.append(StopStrings(tokenizer, request.stop_strings, candidates))
        stop = EitherStop(*stops) if stops else None
        generator = torch.Generator(device=base.device)
        generator.manual_seed(request.seed if request.seed is not None else int(torch.seed() % (1 << 62)))
        ids = torch.tensor([request.prompt], device=base.device)
        eos = tokenizer.eos_token_id
        model = base.model if base.model is not None else base.base
        with base.active(adapter):
            tokens, logp = decode(model, ids, torch.ones_like(ids), n=request.num_samples,
                                  max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                                  eos=eos, pad=tokenizer.pad_token_id, generator=generator, stop=stop)  # fmt: skip
        ends = stop.ends if stop is not None else {}
        sequences = []
        for row, (row_tokens, row_logp) in enumerate(zip(tokens.tolist(), logp.tolist(), strict=True)):
            if row in ends:
                length, reason = ends[row], "stop"
            elif eos in row_tokens:
                length, reason = row_tokens.index(eos) + 1, "stop"
            else:
                length, reason = len(row_tokens), "length"
            sequences.append(Sequence(row_tokens[:length], row_logp[:length], reason))
        return sequences

"""Sampling for the server: sampler snapshots (adapters frozen at `save_weights_for_sampler`) held as adapters on the
shared base, and the HF engine's decode loop run with one snapshot active, ending responses at end-of-sequence, at
stop token ids or at stop strings. The snapshots stay in memory: a run's new sampler weights never touch the disk."""

import contextlib
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from lorarl.trainer.decode import StopStrings, decode, left_padded, response_end
from lorarl.trainer.engines.hf import stop_candidates
from lorarl.trainer.serve.tenancy import Datum, LoraShape, RequestError, SharedBase

BASE_ROW = "__base__"  # peft's name for a row of a mixed batch that the base model answers


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


def check_request(base: SharedBase, request: SampleRequest) -> None:
    """A request this base can answer: its prompt's and stop tokens' ids in the vocabulary."""
    if not request.prompt:
        raise RequestError("prompt: expected at least one token")
    for what, ids in (("prompt", request.prompt), ("stop", request.stop_tokens)):
        if ids and (max(ids) >= base.vocab_size or min(ids) < 0):
            raise RequestError(f"{what}: token ids must be in [0, {base.vocab_size}) for {base.name}")


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

    def __init__(self, base: SharedBase, loaded: int = 16, max_rows: int = 64):
        self.base, self.capacity, self.max_rows = base, loaded, max_rows
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
        self.base.load_adapter_tensors(name, snapshot.tensors, share=True)
        self.loaded[path] = None
        while len(self.loaded) > self.capacity:
            old, _ = self.loaded.popitem(last=False)
            self.base.remove_adapter(self.slot(old))
        return name

    def forget(self, path: str) -> None:
        if self.loaded.pop(path, 0) is None:
            self.base.remove_adapter(self.slot(path))

    def check(self, request: SampleRequest) -> None:
        check_request(self.base, request)

    def prompt_logprobs(self, adapter: str | None, prompt: list[int]) -> list[float | None]:
        """Each prompt token's log-prob given those before it (None for the first), under `adapter`'s weights."""
        if len(prompt) < 2:
            return [None] * len(prompt)
        datum = Datum(prompt[:-1], torch.tensor(prompt[1:]), {})
        with torch.no_grad():
            ((_, logp),) = list(self.base.target_logprobs(adapter, [datum]))
        return [None, *logp.tolist()]

    def close(self) -> None:
        """Nothing to release: the snapshots' adapters go with the base."""

    def sample_many(self, requests: list[tuple[str | None, SampleRequest]]) -> list[list[Sequence]]:
        """The responses to each request, those that sample alike decoded together — one batch for many tenants'
        adapters (peft's mixed-batch forward; adapter by adapter where they adapt fused experts). A seeded request
        decodes alone: its samples depend on its seed only."""
        groups: dict[tuple, list[int]] = {}
        mixes = self.base.mixes_adapters  # else (adapters on fused experts) one adapter per decode
        for i, (adapter, request) in enumerate(requests):
            key = (request.num_samples, request.temperature, request.top_p, request.max_tokens, request.stop_strings,
                   request.stop_tokens, i if request.seed is not None else None,
                   None if mixes else adapter)  # fmt: skip
            groups.setdefault(key, []).append(i)
        answers: list[list[Sequence]] = [[] for _ in requests]
        for members in groups.values():
            per_decode = max(1, self.max_rows // requests[members[0]][1].num_samples)
            for start in range(0, len(members), per_decode):
                chunk = members[start : start + per_decode]
                for i, sequences in zip(chunk, self._decode([requests[i] for i in chunk]), strict=True):
                    answers[i] = sequences
        return answers

    @torch.no_grad()
    def _decode(self, requests: list[tuple[str | None, SampleRequest]]) -> list[list[Sequence]]:
        """Requests that sample alike (all but their prompts and adapters), in one decode."""
        base = self.base
        tokenizer = base.tokenizer
        first = requests[0][1]
        for _, request in requests:
            self.check(request)
        stops = []
        if first.stop_tokens:
            stops.append(StopTokens(first.stop_tokens))
        if first.stop_strings:
            candidates = stop_candidates(tokenizer, first.stop_strings, base.vocab_size)
            stops.append(StopStrings(tokenizer, first.stop_strings, candidates))
        stop = EitherStop(*stops) if stops else None
        generator = torch.Generator(device=base.device)
        generator.manual_seed(first.seed if first.seed is not None else int(torch.seed() % (1 << 62)))
        pad = tokenizer.pad_token_id
        ids, mask = left_padded([r.prompt for _, r in requests], pad, base.device)
        adapters = [adapter for adapter, _ in requests]
        mixed = len(set(adapters)) > 1
        names = [BASE_ROW if a is None else a for a in adapters] if mixed else None
        eos = tokenizer.eos_token_id
        model = base.model if base.model is not None else base.base
        with contextlib.nullcontext() if mixed else base.active(adapters[0]):
            tokens, logp = decode(model, ids, mask, n=first.num_samples, max_tokens=first.max_tokens,
                                  temperature=first.temperature, top_p=first.top_p, eos=eos, pad=pad,
                                  generator=generator, stop=stop, adapter_names=names)  # fmt: skip
        ends = stop.ends if stop is not None else {}
        sequences = []
        for row, (row_tokens, row_logp) in enumerate(zip(tokens.tolist(), logp.tolist(), strict=True)):
            length, finished = response_end(row_tokens, eos, ends.get(row))
            sequences.append(Sequence(row_tokens[:length], row_logp[:length], "stop" if finished else "length"))
        n = first.num_samples
        return [sequences[i * n : (i + 1) * n] for i in range(len(requests))]

"""The engine contract, in one place: the `RolloutEngine` protocol (every call the trainer makes), the sampling
parameters and completions, the capabilities an engine declares, the `Worker` base that engine implementations (HF,
vLLM, a plugin's) derive from, and their registry.

An engine is a *worker* (what generates: `hf.py`, `vllm_worker.py`) in a *placement* (where it runs: `inline.py` in
the trainer's process, `process.py` in a process of its own, `ray_actors.py` as Ray actors). Every completion says which
weight version produced it, so the trainer never trains on rollouts of stale weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from lorarl.trainer.errors import TrainerError
from lorarl.trainer.registry import Plugin, Registry, import_object

if TYPE_CHECKING:  # (the configuration reads this module: no torch at import)
    import torch

    from lorarl.weight_sync import SyncStats, Update


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's responses: `n` per prompt, greedy when `temperature` is 0, seeded (the same
    request, the same samples: what makes a resumed run repeat an uninterrupted one)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int = 0
    stop: tuple[str, ...] = ()  # strings that end a response besides end-of-sequence (kept in it)
    min_tokens: int = 0  # end-of-sequence cannot be drawn (nor a stop string end a response) before this many tokens

    def __post_init__(self):
        if self.n < 1 or self.max_tokens < 1 or self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"expected n >= 1, max_tokens >= 1, temperature >= 0 and 0 < top_p <= 1; got {self}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"expected 0 <= min_tokens <= max_tokens; got {self}")
        if self.temperature == 0 and self.n != 1:
            raise ValueError(f"greedy decoding (temperature=0) gives one response per prompt, got n={self.n}")


GREEDY = SamplingParams(n=1, temperature=0.0)

# how a request samples: one `SamplingParams` for all its prompts (drawing from one stream seeded `seed`), or one per
# prompt (each drawing from a stream of its own `seed`: its samples do not depend on the other prompts of the request)
Sampling = SamplingParams | Sequence[SamplingParams]


def stop_strings(sampling: Sampling) -> tuple[str, ...]:
    """Every stop string of a request."""
    each = [sampling] if isinstance(sampling, SamplingParams) else sampling
    return tuple(sorted({text for params in each for text in params.stop}))


@dataclass(frozen=True)
class Completion:
    prompt_index: int
    token_ids: tuple[int, ...]  # the response, with the end-of-sequence token when it stopped on it
    logprobs: tuple[float, ...]  # the engine's log-probs of those tokens (its sampling distribution)
    finished: bool  # stopped on end-of-sequence or a stop string (False: cut at max_tokens)
    version: int  # weights that produced it
    # with `EngineContext.record_routes`: the experts of every token but the last (`routing`: int16 numpy
    # [prompt + response - 1, layers, k]), else None
    routes: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond the protocol's core; the trainer reads these, never infers them."""

    sleep: bool = False  # `sleep()` frees its device while the trainer trains; the next sync wakes it
    background: bool = False  # `submit()` returns at once and generates beside the caller (`rollout.overlap`)
    checksum: bool = False  # `checksum()` digests weights laid out as the trainer's merged weights
    keeps_weights: bool = True  # holds its weights between updates: one may cover only the layers that changed


class RolloutEngine(Protocol):
    """Every call the trainer makes to a rollout engine, whatever runs it (`inline.py`, `process.py`,
    `ray_actors.py`). Each sync installs one weight version whole or fails leaving the previous one serving; every
    completion carries the version that produced it."""

    version: int  # the weights it generates with (0: those it loaded from disk)
    capabilities: Capabilities

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        """`n` completions per prompt, prompt by prompt, in order (`sampling`: one for all, or one per prompt)."""
        ...

    def submit(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> Callable[[], list[Completion]]:
        """`generate`, returning what waits for its completions (called before any other request to the engine);
        with `capabilities.background` it generates while the caller goes on."""
        ...

    def sync(self, update: Update) -> SyncStats:
        """Install `update` (`weight_sync.Update`: full weights, a factor set or an adapter; its form is all the engine
        reads) as version `update.version`, whole, or fail leaving the previous version serving."""
        ...

    def sleep(self) -> None:
        """With `capabilities.sleep`: free the device while the trainer trains."""
        ...

    def checksum(self) -> str:
        """With `capabilities.checksum`: a digest of its weights, equal to `engines.hf.checksum` of the trainer's
        merged weights when they are bit-identical."""
        ...

    def close(self) -> None: ...


class SubmitsInBackground:
    """`generate` as `submit`, then wait: for the placements whose worker generates beside the caller."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        return self.submit(prompts, sampling)()


class GeneratesWhenAsked:
    """`submit` that generates at once and hands back the result: for engines that share the trainer's process or
    device, where nothing could overlap with training."""

    def submit(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> Callable[[], list[Completion]]:
        completions = self.generate(prompts, sampling)
        return lambda: completions

    def sleep(self) -> None:
        """Nothing to free: it has no `sleep` capability."""


class EngineError(TrainerError):
    """The rollout engine failed (its own traceback is in the message) or died."""


@dataclass(frozen=True)
class EngineContext:
    """What the trainer knows that an engine needs to start: its model, dtype, device, tokens, and the forms of the
    updates the run may send (an engine that serves adapters unmerged prepares for them: vLLM's LoRA support)."""

    model_path: str
    dtype: torch.dtype
    device: str
    eos_token_id: int
    pad_token_id: int
    seed: int
    forms: tuple[str, ...]  # the forms (`weight_sync.FORMS`) of the updates this run may send
    lora_rank: int  # the rank of the adapter an "adapter" update carries (0: full fine-tuning)
    overlap: bool  # rollout.overlap: the engine generates beside the training
    inline: bool = False  # the engine shares the trainer's process (`rollout.worker=inline`)
    bucket_bytes: int = 256 << 20  # rollout.bucket_mb: the size of the buckets weights travel in
    sequences: int = 1  # sequences a step's rollouts generate at once (prompts × responses)
    sequence_tokens: int = 2048  # the longest of them: prompt and response, in tokens
    threads: int = 0  # trainer.threads: a fixed count of torch CPU threads per process (0: adapted to the load)
    record_routes: bool = False  # each completion carries the experts its tokens were routed to (a mixture's)


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker starts from unless it builds its own settings (`Worker.settings`): its engine's settings
    (`rollout.<engine>.*`) and the trainer's context, with what a placement reads (`timeout`, `sync_backend`,
    `sync_ranks`, `dtype`, `device`)."""

    own: Any
    context: EngineContext
    timeout: float = 600.0
    sync_ranks: int = 1  # ranks it takes in a sync group

    @property
    def dtype(self) -> torch.dtype:
        return self.context.dtype

    @property
    def device(self) -> str:
        return self.context.device

    @property
    def sync_backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"


class Worker:
    """An engine implementation, built from its settings (`settings()`), driven by a placement:
    - inline, in the trainer's process (`inline.InlineEngine`): `generate`, and `apply` for each update (no wire);
    - in a process or Ray actor of its own: `generate`, and over a channel (`weight_sync.channels`, a sync group)
      `join`, then `receive` for each update (returning the version it now serves).
    A method an engine lacks raises. Registered by name with `@register_engine("name", settings=...)`: the name
    becomes a choice of `rollout.engine`, its settings `rollout.<name>.*`."""

    capabilities: Capabilities = Capabilities()  # a class's, or (where settings decide) an instance's
    version: int

    @classmethod
    def settings(cls, own: Any, context: EngineContext) -> Any:
        """This worker's (picklable) settings, from its engine's settings and the trainer's context: they carry
        `timeout`, `sync_backend`, `sync_ranks`, `dtype` and `device`, which the placements read."""
        return WorkerSettings(own, context)

    @classmethod
    def needs_own_process(cls, own: Any) -> bool:
        """Whether these settings ask for a process of its own even with `rollout.worker=inline` (devices of its
        own)."""
        return False

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        raise NotImplementedError

    def apply(self, update: Update, *, shared: bool = False) -> SyncStats:
        """Install `update` in the trainer's process (`shared`: its tensors are the trainer's own, which it changes
        after: copy what is kept of an adapter; a factor set's base weights may be held as they are)."""
        raise EngineError(f"{type(self).__name__} cannot take weights in the trainer's process")

    def join(self, host: str, port: int, world_size: int, rank: int) -> int:
        """Open this worker's end (`rank`) of the trainer's channel; return the version it serves."""
        raise EngineError(f"{type(self).__name__} cannot run in a process of its own (rollout.worker=process)")

    def receive(self, form: str, version: int) -> int:
        """Receive the update the trainer sends as `version` in `form` and install it; return the version served."""
        raise EngineError(f"{type(self).__name__} cannot receive weights over a channel")

    def sleep(self) -> None:
        """With `capabilities.sleep` (inline): free the device while the trainer trains; the next update or
        generation wakes it."""

    def checksum(self) -> str:
        raise EngineError(f"{type(self).__name__} has no weights checksum comparable to the trainer's")

    def close(self) -> None:
        """Release what the worker holds beyond its memory (an engine's processes, files); nothing by default."""


@dataclass(frozen=True)
class Engine(Plugin):
    """A registered rollout engine: `target` is its `Worker` class — or, for the built-in ones, the class's import
    path, imported when an engine starts (the configuration reads this registry without importing torch); `about`
    describes it where its docstring is not loaded yet; `requires`: a module it cannot run without, and how to get
    it (checked with the configuration, before anything loads)."""

    about: str = ""
    requires: tuple[str, str] | None = None

    @property
    def worker(self) -> type[Worker]:
        return import_object(self.target) if isinstance(self.target, str) else self.target

    @property
    def summary(self) -> str:
        return self.about or super().summary


ENGINES: Registry[Engine] = Registry("rollout engine", Engine)
register_engine = ENGINES.register


def agreed(values: list, what: str):
    """The one value that every worker of an engine (or every replica) reports as `what`."""
    if len(set(values)) != 1:
        raise EngineError(f"the rollout workers disagree on their {what}: {values}")
    return values[0]

"""What every rollout engine is to the trainer: the `RolloutEngine` protocol, the completions it returns, the
capabilities it declares, and the `Worker` base that engine implementations (HF, vLLM) derive from.

An engine is a *worker* (what generates: `hf.py`, `vllm_worker.py`) in a *placement* (where it runs: `inline.py` in
the trainer's process, `process.py` in a process of its own, `ray.py` as Ray actors). Every completion says which
weight version produced it, so the trainer never trains on rollouts of stale weights.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from lorarl.trainer.errors import TrainerError
from lorarl.weight_sync import SyncStats, TensorSpec


@dataclass(frozen=True)
class Completion:
    prompt_index: int
    token_ids: tuple[int, ...]  # the response, with the end-of-sequence token when it stopped on it
    logprobs: tuple[float, ...]  # the engine's log-probs of those tokens (its sampling distribution)
    finished: bool  # stopped on end-of-sequence (False: cut at max_tokens)
    version: int  # weights that produced it


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond the protocol's core (the trainer asks these, never `hasattr`)."""

    sleep: bool = False  # `sleep()` frees its device while the trainer trains; the next sync wakes it
    background: bool = False  # `submit()` returns at once and generates beside the caller (`rollout.overlap`)
    checksum: bool = False  # `checksum()` digests weights laid out as the trainer's merged weights


class RolloutEngine(Protocol):
    version: int  # the weights it generates with (0: those it loaded from disk)
    capabilities: Capabilities

    def generate(
        self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> list[Completion]: ...

    def submit(
        self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> Callable[[], list[Completion]]:
        """`generate`, returning what waits for its completions (called before any other request to the engine)."""
        ...

    def sync_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, manifest: Sequence[TensorSpec | tuple]
    ) -> SyncStats:
        """Full (merged) weights, as version `version`."""
        ...

    def sync_adapter(self, tensors: dict[str, torch.Tensor], config: dict, *, version: int) -> SyncStats:
        """A LoRA adapter (peft tensors and config), served unmerged on the weights the engine holds."""
        ...

    def sync_factors(self, tensors: dict[str, torch.Tensor], *, version: int) -> SyncStats:
        """A factor set (`weight_sync.factors`): the engine merges the LoRA factors into its serving weights from
        the pristine base weights it keeps (which the first set carries)."""
        ...

    def sleep(self) -> None: ...

    def checksum(self) -> str: ...

    def close(self) -> None: ...


class SubmitsInBackground:
    """`generate` as `submit`, then wait: for the placements whose worker generates beside the caller."""

    def generate(
        self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> list[Completion]:
        return self.submit(prompts, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)()


class GeneratesWhenAsked:
    """`submit` that generates at once and hands back the result: for engines that share the trainer's process or
    device, where nothing could overlap with training."""

    def submit(
        self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> Callable[[], list[Completion]]:
        completions = self.generate(prompts, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                    seed=seed)  # fmt: skip
        return lambda: completions


class EngineError(TrainerError):
    """The rollout engine failed (its own traceback is in the message) or died."""


@dataclass(frozen=True)
class EngineContext:
    """What the trainer knows that an engine needs to start: its model, dtype, device, tokens and the sync mode."""

    model_path: str
    dtype: torch.dtype
    device: str
    eos_token_id: int
    pad_token_id: int
    seed: int
    adapter_rank: int | None  # serve a LoRA adapter of this rank unmerged (rollout.sync=adapter or auto), else None
    overlap: bool  # rollout.overlap: the engine generates beside the training
    sequences: int = 1  # sequences a step's rollouts generate at once (prompts × responses)
    sequence_tokens: int = 2048  # the longest of them: prompt and response, in tokens


class Worker:
    """An engine implementation: builds its model from typed settings and generates. A placement drives it —
    `inline` calls it in this process (`load_weights`, `serve_adapter`, `serve_factors`: no wire), `process` and
    `ray` over a sync group (`join`, then `receive` / `receive_adapter` / `receive_factors` for each version).
    Registered by name with `engines.register_engine`, which makes the name a choice of `rollout.engine`."""

    capabilities: ClassVar[Capabilities] = Capabilities()
    version: int

    @classmethod
    def settings(cls, rollout: Any, context: EngineContext) -> Any:
        """This worker's settings (a picklable dataclass with `timeout`, `sync_backend` and `sync_ranks`) from the
        `rollout` config section and the trainer's context."""
        raise NotImplementedError

    @classmethod
    def inline(cls, settings: Any, *, bucket_bytes: int) -> RolloutEngine:
        """The engine in the trainer's process (`rollout.worker=inline`)."""
        from lorarl.trainer.engines.inline import InlineEngine

        return InlineEngine(cls(settings))

    def generate(self, prompts, n, temperature, top_p, max_tokens, seed) -> list[Completion]:
        raise NotImplementedError

    def checksum(self) -> str:
        raise EngineError(f"{type(self).__name__} has no weights checksum comparable to the trainer's")

    def close(self) -> None:
        """Release what the worker holds beyond its memory (an engine's processes, files); nothing by default."""


def agreed(values: list, what: str):
    """The one value that every worker of an engine (or every replica) reports as `what`."""
    if len(set(values)) != 1:
        raise EngineError(f"the rollout workers disagree on their {what}: {values}")
    return values[0]

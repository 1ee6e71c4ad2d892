"""Reward functions: built-ins or the user's own, in the signature they were written for, weighted, optionally scored
in a process pool with a per-call timeout.

`reward.fn` (or several: `reward.fns` with `reward.weights`) names each function: `default` (the embedded task),
`math`, `package.module:function` or `path/to/file.py:function`. Three signatures are recognised by their parameter
names, so verl's and TRL's reward code runs unchanged:
- `f(prompt, response, answer) -> float`, one response per call (lorarl's own);
- TRL's `f(prompts, completions, **columns) -> list[float | None]` (any with a `completions` parameter), batched:
  `prompts` as in the data (text or chat messages), `completions` text (or `[{"role": "assistant", "content": ...}]`
  for chat prompts, as TRL passes them), `completion_ids`, and every other dataset column as a keyword list; None =
  no score from this function;
- verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict` (a dict's `score`).
"""

import importlib
import importlib.util
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lorarl.trainer import default_task
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.math_reward import math_exact
from lorarl.trainer.schema import RewardSection

BUILT_IN: dict[str, Callable] = {"default": default_task.reward, "math": math_exact}


def load_reward(spec: str) -> Callable:
    """A built-in by name, or `package.module:function`, or `path/to/file.py:function`."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    if ":" not in spec:
        raise TrainerError(f"reward.fn={spec!r}: not a built-in ({', '.join(BUILT_IN)}) nor module:function")
    target, name = spec.rsplit(":", 1)
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise TrainerError(f"reward.fn={spec!r}: file {path} not found")
            module_spec = importlib.util.spec_from_file_location(f"lorarl_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as e:
        raise TrainerError(f"reward.fn={spec!r}: cannot import {target}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise TrainerError(f"reward.fn={spec!r}: {target} has no function {name!r}")
    return fn


@dataclass(frozen=True)
class Response:
    """What a reward function may read of one response to a prompt."""

    prompt: str | list[dict]  # as in the data
    response: str
    answer: str
    columns: dict  # the data row's other fields (data_source, extra_info, TRL's dataset columns)
    completion_ids: Sequence[int] = ()


def style(fn: Callable) -> str:
    """Which signature `fn` was written for, by its parameter names: "trl" (completions, often prompts), "verl"
    (solution_str, ground_truth) or "lorarl" (prompt, response, answer)."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "lorarl"
    if "completions" in names:
        return "trl"
    if {"solution_str", "ground_truth"} <= names:
        return "verl"
    return "lorarl"


def call(fn: Callable, responses: Sequence[Response]) -> list[float | None]:
    """`fn`'s scores of `responses`, called in its own signature (one call for TRL's, one per response otherwise).
    Raises `RewardError` naming the response a failure or a non-number came from."""
    kind = style(fn)
    if kind == "trl":
        try:
            values = list(fn(**_trl_arguments(fn, responses)))
        except Exception as e:
            raise RewardError(_raised(e), responses[0]) from e
        if len(values) != len(responses):
            raise RewardError(f"returned {len(values)} scores for {len(responses)} completions", responses[0])
        return [_checked(v, s, allow_none=True) for v, s in zip(values, responses, strict=True)]
    scores = []
    for response in responses:
        try:
            if kind == "verl":
                value = fn(data_source=response.columns.get("data_source"), solution_str=response.response,
                           ground_truth=response.answer, extra_info=response.columns.get("extra_info"))  # fmt: skip
                value = value["score"] if isinstance(value, dict) else value
            else:
                value = fn(response.prompt, response.response, response.answer)
        except Exception as e:
            raise RewardError(_raised(e), response) from e
        scores.append(_checked(value, response, allow_none=False))
    return scores


def _trl_arguments(fn: Callable, responses: Sequence[Response]) -> dict:
    """TRL's keyword arguments: prompts, completions (chat messages for chat prompts), completion_ids, and each
    dataset column present in every response, as lists; only those `fn` takes, unless it takes **kwargs."""
    chat = isinstance(responses[0].prompt, list)
    arguments = {
        "prompts": [s.prompt for s in responses],
        "completions": [[{"role": "assistant", "content": s.response}] if chat else s.response for s in responses],
        "completion_ids": [list(s.completion_ids) for s in responses],
    }
    shared = set.intersection(*(set(s.columns) for s in responses)) - arguments.keys()
    arguments.update({key: [s.columns[key] for s in responses] for key in sorted(shared)})
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return arguments
    names = {p.name for p in parameters}
    return {key: value for key, value in arguments.items() if key in names}


def _checked(value, response: Response, *, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, numbers.Real) or math.isnan(value):
        raise RewardError(f"returned {value!r}, not a number", response)
    return float(value)


class RewardError(TrainerError):
    """A reward function failed on a response (raised, timed out, returned a non-number); the message shows it."""

    def __init__(self, problem: str, response: Response):
        self.problem, self.response = problem, response
        super().__init__(f"the reward function {problem} on: prompt={response.prompt!r}, "
                         f"response={response.response!r}, answer={response.answer!r}")  # fmt: skip


def _raised(error: BaseException) -> str:
    return f"raised {type(error).__name__}: {error}"


@dataclass(frozen=True)
class Score:
    total: float  # the weighted sum of the parts (None: no score from that function, counted 0)
    parts: tuple[float | None, ...]  # each function's score
    errors: int = 0  # calls that failed and were scored reward.error_score


class Rewards:
    """The run's reward: the weighted sum of its functions' scores (a None counts 0, as in TRL), each function's mean
    logged as `reward/fn/<name>` when there are several. A failure raises — or, with `reward.on_error=score`, scores
    `reward.error_score`, counted in `reward/errors`. With `reward.workers`, a pool of processes scores the
    responses, each call stopped after `reward.timeout_s`."""

    def __init__(self, section: RewardSection):
        specs = list(section.fns) or [section.fn]
        weights = list(section.weights) or [1.0] * len(specs)  # (one per function: checked with the config)
        self.specs, self.weights, self.section = specs, weights, section
        self.fns = [load_reward(spec) for spec in specs]
        self.names = [spec.rsplit(":", 1)[-1] for spec in specs]
        self.pool = ScoringPool(specs, section.workers, section.timeout_s) if section.workers else None

    def score(self, responses: Sequence[Response]) -> list[Score]:
        """Each response's reward and its functions' parts."""
        parts: list[list[float | None]] = [[] for _ in responses]
        errors = [0] * len(responses)
        for index, fn in enumerate(self.fns):
            if self.pool is not None:
                results = self.pool.score(index, responses)
            elif self.section.on_error == "raise":
                results = call(fn, responses)
            else:  # one call per response, so that one failure leaves the others scored
                results = [_caught(fn, response) for response in responses]
            for i, result in enumerate(results):
                if isinstance(result, RewardError):
                    if self.section.on_error == "raise":
                        raise result
                    errors[i] += 1
                    result = self.section.error_score
                parts[i].append(result)
        return [Score(sum(w * p for w, p in zip(self.weights, ps, strict=True) if p is not None), tuple(ps), e)
                for ps, e in zip(parts, errors, strict=True)]  # fmt: skip

    def metrics(self, scores: Sequence[Score]) -> dict:
        """Each function's mean over the responses it scored (with several functions), and the failed calls."""
        metrics = {}
        if len(self.fns) > 1:
            for index, name in enumerate(self.names):
                given = [s.parts[index] for s in scores if s.parts[index] is not None]
                if given:
                    metrics[f"reward/fn/{name}"] = sum(given) / len(given)
        errors = sum(s.errors for s in scores)
        if errors:
            metrics["reward/errors"] = errors
        return metrics

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _caught(fn: Callable, response: Response) -> float | RewardError | None:
    try:
        return call(fn, [response])[0]
    except RewardError as e:
        return e


class ScoringPool:
    """Processes (spawned: no state forked from the trainer) that load the reward functions once and score one response
    per call, each call stopped by a timer after `timeout` s (0: none). A worker stuck where the timer cannot reach
    (inside C code) is killed with the pool, which starts again; its responses count as timed out."""

    def __init__(self, specs: list[str], workers: int, timeout: float):
        self.specs, self.workers, self.timeout = specs, workers, timeout
        self.executor = None  # started when first used (only the rank that scores uses it)

    def _start(self) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_load_in_worker, initargs=(self.specs,))  # fmt: skip
        for future in [self.executor.submit(int) for _ in range(self.workers)]:
            future.result()  # started and loaded: the time limits below are the calls' own

    def score(self, index: int, responses: Sequence[Response]) -> list[float | RewardError | None]:
        from concurrent.futures import wait

        if self.executor is None:
            self._start()
        futures = [self.executor.submit(_score_in_worker, index, response, self.timeout) for response in responses]
        rounds = -(-len(responses) // self.workers) + 1
        _, stuck = wait(futures, timeout=rounds * self.timeout + 2 if self.timeout else None)
        results = []
        for future, response in zip(futures, responses, strict=True):
            if future in stuck:
                results.append(RewardError(f"did not answer within {self.timeout} s (its worker was killed)", response))
                continue
            value = future.result()
            results.append(RewardError(value[1], response) if isinstance(value, tuple) else value)
        if stuck:
            self.close()  # started again for the next call
        return results

    def close(self) -> None:
        if self.executor is None:
            return
        for process in list((self.executor._processes or {}).values()):
            process.kill()  # a worker stuck in C code ignores everything else
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.executor = None


_WORKER_FNS: list[Callable] = []


def _load_in_worker(specs: list[str]) -> None:
    _WORKER_FNS[:] = [load_reward(spec) for spec in specs]


def _score_in_worker(index: int, response: Response, timeout: float) -> float | tuple[str, str] | None:
    """A score, None, or ("error", what happened): an exception holding the response would not pickle back."""
    import signal

    def expire(signum, frame):
        raise TimeoutError(f"timed out after {timeout} s")

    if timeout:
        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return call(_WORKER_FNS[index], [response])[0]
    except RewardError as e:
        return ("error", e.problem)
    finally:
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, 0)

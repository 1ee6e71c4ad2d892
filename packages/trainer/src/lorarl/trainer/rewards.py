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

A reward with settings of its own is decorated: `@register_reward("name", settings=Dataclass)` (and `format=...` to
name its signature instead of having it recognised); its settings are `reward.<name>.*` and reach it as keywords.
"""

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lorarl.trainer import default_task
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.math_reward import math_exact
from lorarl.trainer.registry import Plugin, PluginError, Registry, import_object


@dataclass(frozen=True)
class Reward(Plugin):
    """A reward function; `format` is its signature: a `REWARD_FORMATS` name, or auto (recognised by its parameter
    names). Its settings (`reward.<name>.*`) reach it as keywords."""

    format: str = "auto"


REWARDS: Registry[Reward] = Registry("reward", Reward)
register_reward = REWARDS.register
REWARD_FORMATS: Registry[Plugin] = Registry("reward format")
register_reward("default")(default_task.reward)
register_reward("math")(math_exact)


@register_reward("none")
def no_reward(prompt: str, response: str, answer: str) -> float:
    """0 for every response: an environment's own rewards are the whole return (SkyRL-gym's, TRL's get_reward)."""
    return 0.0


def load_reward(spec: str) -> Reward:
    """A registered reward by name, or `package.module:function` / `path/to/file.py:function`: a registered
    (decorated) reward, or a plain function in any of the formats."""
    try:
        if ":" not in spec:
            return REWARDS[spec]
        found = import_object(spec)
    except PluginError as e:
        raise TrainerError(f"reward.fn={spec!r}: {e}") from None
    if (registered := REWARDS.entry_of(found)) is None and not callable(found):
        raise TrainerError(f"reward.fn={spec!r}: not a function")
    reward = registered or Reward(spec.rsplit(":", 1)[1], found)
    _check_signature(reward, spec)
    return reward


def _check_signature(reward: Reward, spec: str) -> None:
    """A per-response reward must take the arguments its format passes (and its settings, as keywords): checked when
    it loads, not at the first step's scoring, minutes later on a real model. (TRL's format passes the arguments a
    function names.)"""
    form = style(reward)
    if form not in PER_RESPONSE:
        return
    try:
        signature = inspect.signature(reward.target)
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    shown, arguments = PER_RESPONSE[form]
    positional, keywords = arguments(Response("", "", "", {}))
    try:
        signature.bind(*positional, **keywords, **reward.keywords())
    except TypeError as e:
        raise TrainerError(f"reward.fn={spec!r}: {reward.target.__name__}{signature} cannot be called as {shown} "
                           f"({e}); a batched TRL reward takes `completions`") from None  # fmt: skip


@dataclass(frozen=True)
class Response:
    """What a reward function may read of one response to a prompt."""

    prompt: str | list[dict]  # as in the data
    response: str
    answer: str
    columns: dict  # the data row's other fields (data_source, extra_info, TRL's dataset columns)
    completion_ids: Sequence[int] = ()


def style(fn: Callable) -> str:
    """Which format `fn` was written for, by its parameter names: "trl" (completions, often prompts), "verl"
    (solution_str, ground_truth) or "lorarl" (prompt, response, answer)."""
    if isinstance(fn, Reward):
        return fn.format if fn.format != "auto" else style(fn.target)
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "lorarl"
    if "completions" in names:
        return "trl"
    if {"solution_str", "ground_truth"} <= names:
        return "verl"
    return "lorarl"


def call(fn: Callable, responses: Sequence[Response], options: dict | None = None) -> list[float | None]:
    """`fn`'s scores of `responses`, called in its own format (one call for TRL's, one per response otherwise) with
    its settings `options` as keywords. Raises `RewardError` naming the response a failure or a non-number came
    from."""
    return REWARD_FORMATS[style(fn)](getattr(fn, "target", fn), responses, options or {})


@REWARD_FORMATS.register("trl")
def call_trl(fn: Callable, responses: Sequence[Response], options: dict) -> list[float | None]:
    """TRL's `f(prompts, completions, **columns) -> list[float | None]`, one call for the batch."""
    try:
        values = list(fn(**_trl_arguments(fn, responses), **options))
    except Exception as e:
        raise RewardError(_raised(e), responses[0]) from e
    if len(values) != len(responses):
        raise RewardError(f"returned {len(values)} scores for {len(responses)} completions", responses[0])
    return [_checked(v, s, allow_none=True) for v, s in zip(values, responses, strict=True)]


def _verl_arguments(response: Response) -> tuple[tuple, dict]:
    return (), {"data_source": response.columns.get("data_source"), "solution_str": response.response,
                "ground_truth": response.answer, "extra_info": response.columns.get("extra_info")}  # fmt: skip


def _lorarl_arguments(response: Response) -> tuple[tuple, dict]:
    return (response.prompt, response.response, response.answer), {}


# the formats that call a reward once per response: how the call reads, and its arguments for a response
PER_RESPONSE = {"verl": ("compute_score(data_source, solution_str, ground_truth, extra_info)", _verl_arguments),
                "lorarl": ("f(prompt, response, answer)", _lorarl_arguments)}  # fmt: skip


@REWARD_FORMATS.register("verl")
def call_verl(fn: Callable, responses: Sequence[Response], options: dict) -> list[float | None]:
    """verl's `compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict`, per response."""

    def score(response: Response):
        positional, keywords = _verl_arguments(response)
        value = fn(*positional, **keywords, **options)
        return value["score"] if isinstance(value, dict) else value

    return _per_response(score, responses)


@REWARD_FORMATS.register("lorarl")
def call_lorarl(fn: Callable, responses: Sequence[Response], options: dict) -> list[float | None]:
    """lorarl's `f(prompt, response, answer) -> float`, per response."""

    def score(response: Response):
        positional, keywords = _lorarl_arguments(response)
        return fn(*positional, **keywords, **options)

    return _per_response(score, responses)


def _per_response(score: Callable[[Response], object], responses: Sequence[Response]) -> list[float | None]:
    scores = []
    for response in responses:
        try:
            value = score(response)
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

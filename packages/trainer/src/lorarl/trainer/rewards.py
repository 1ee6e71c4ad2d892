"""Reward functions: built-ins or the user's own, in the signature they were written for, weighted, optionally scored
in a process pool with a per-call timeout.

`reward.fn` (or several: `reward.fns` with `reward.weights`) names each function: `default` (the embedded task),
`math`, `package.module:function` or `path/to/file.py:function`. Three signatures are recognised by their parameter
names, so verl's and TRL's reward code runs unchanged:
- `f(prompt, response, answer) -> float`, one response per call (lorarl's own);
- TRL's `f(prompts, completions, **columns) -> list[float | None]` (any that names one of TRL's keywords —
  `prompts`, `completions`, `completion_ids`, `environments`, `trainer_state`, `log_metric`, `log_extra` — or takes
  keywords alone), batched, with what TRL passes: `prompts` as in the data (text or chat messages), `completions` text,
  or for chat prompts the messages after the prompt (`[{"role": "assistant", "content": ...}]`; an episode with tools:
  the assistant turns with their `tool_calls`, the `tool` messages, the last answer), `completion_ids`, every other
  dataset column as a keyword list, `environments` (a TRL environment's instances), `trainer_state` (a transformers
  `TrainerState`: `global_step` the optimizer steps done, `max_steps`), `log_metric(name, value)` (logged as `name`,
  the step's mean) and `log_extra(column, values)` (TRL's completions table, which lorarl does not keep); None = no
  score from this function;
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
    answer: str | None  # None: the data has none (a reward that reads it is refused when the run starts)
    columns: dict  # the data row's other fields (data_source, extra_info, TRL's dataset columns)
    completion_ids: Sequence[int] = ()
    messages: tuple[dict, ...] = ()  # a chat episode's messages after the prompt (tool calls and results), if any
    prompt_messages: tuple[dict, ...] = ()  # a chat episode's prompt as it played (a TRL reset's observation added)


TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "environments", "trainer_state", "log_metric", "log_extra")


def style(fn: Callable) -> str:
    """Which format `fn` was written for, by its parameters: "trl" (one of TRL's keywords, or keywords alone:
    `f(environments, **kwargs)`, `f(**kwargs)`), "verl" (solution_str, ground_truth) or "lorarl" (prompt, response,
    answer: positional)."""
    if isinstance(fn, Reward):
        return fn.format if fn.format != "auto" else style(fn.target)
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return "lorarl"
    names = {p.name for p in parameters}
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    if names & set(TRL_KEYWORDS) or not positional:
        return "trl"
    if {"solution_str", "ground_truth"} <= names:
        return "verl"
    return "lorarl"


def reads_answer(reward: Reward) -> bool:
    """Whether `reward` is handed the data's answer as an argument of its own (lorarl's and verl's formats; a TRL
    reward reads whichever columns it names, and `none` reads nothing)."""
    return style(reward) in PER_RESPONSE and reward.target is not no_reward


def call(fn: Callable, responses: Sequence[Response], options: dict | None = None) -> list[float | None]:
    """`fn`'s scores of `responses`, called in its own format (one call for TRL's, one per response otherwise) with
    its settings `options` as keywords. Raises `RewardError` naming the response a failure or a non-number came
    from."""
    return REWARD_FORMATS[style(fn)](getattr(fn, "target", fn), responses, options or {})


@REWARD_FORMATS.register("trl")
def call_trl(fn: Callable, responses: Sequence[Response], options: dict) -> list[float | None]:
    """TRL's `f(prompts, completions, **columns) -> list[float | None]`, one call for the batch (`options` may hold
    the run's `trainer_state` and `log_metric`, which TRL passes too)."""
    try:
        values = list(fn(**_trl_arguments(fn, responses, options)))
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


def _trl_arguments(fn: Callable, responses: Sequence[Response], options: dict) -> dict:
    """TRL's keyword arguments: prompts, completions (chat messages for chat prompts: an episode's whole exchange),
    completion_ids, each dataset column present in every response, as lists, `trainer_state`, `log_metric` and
    `log_extra`, and the function's own settings (`options`); only those `fn` takes, unless it takes **kwargs."""
    chat = isinstance(responses[0].prompt, list) or bool(responses[0].prompt_messages)
    arguments = {
        "prompts": [list(s.prompt_messages) or s.prompt for s in responses],
        "completions": [_completion(s) if chat else s.response for s in responses],
        "completion_ids": [list(s.completion_ids) for s in responses],
    }
    shared = set.intersection(*(set(s.columns) for s in responses)) - arguments.keys()
    arguments.update({key: [s.columns[key] for s in responses] for key in sorted(shared)})
    arguments.update({"trainer_state": None, "log_metric": _ignored, "log_extra": _ignored, **options})
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return arguments
    names = {p.name for p in parameters}
    return {key: value for key, value in arguments.items() if key in names}


def _completion(response: Response) -> list[dict]:
    """A chat completion as TRL hands it to a reward: the messages after the prompt."""
    return list(response.messages) or [{"role": "assistant", "content": response.response}]


def _ignored(*args, **kwargs) -> None:
    """TRL's logging callbacks where nothing collects what they log (a reward scored in a worker process)."""


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

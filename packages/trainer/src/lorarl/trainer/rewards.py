"""Reward functions `(prompt, response, answer) -> float`: built-ins, or the user's own.

`reward.fn`: `default` (the embedded task: exact sum), `math` (exact-match math answers: GSM8K `#### 42` or
`\\boxed{42}`), `package.module:function`, or `path/to/file.py:function`.
"""

import importlib
import importlib.util
import math
import numbers
import re
from collections.abc import Callable
from pathlib import Path

from lorarl.trainer import default_task
from lorarl.trainer.errors import TrainerError

RewardFn = Callable[[str, str, str], float]


def extract_answer(text: str) -> str | None:
    """The final answer in a solution: the last `\\boxed{...}` (braces balanced), else what follows the last `####`."""
    start = text.rfind("\\boxed{")
    if start != -1:
        depth, i = 1, start + len("\\boxed{")
        begin = i
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[begin : i - 1].strip()
    marker = text.rfind("####")
    if marker != -1:
        rest = text[marker + 4 :].strip().splitlines()
        return rest[0].strip() if rest else None
    return None


def _normalize(answer: str) -> str:
    answer = re.sub(r"\\text\{([^}]*)\}", r"\1", answer)
    answer = answer.replace("\\$", "").replace("$", "").replace(",", "").replace("\\!", "").strip()
    return answer.rstrip(".").strip()


def equivalent(predicted: str, reference: str) -> bool:
    """Same answer: numerically when both are numbers (1,000 = 1000.0), else as normalized text."""
    a, b = _normalize(predicted), _normalize(reference)
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:
        return a.replace(" ", "") == b.replace(" ", "")


def math_exact(prompt: str, response: str, answer: str) -> float:
    """1 if the response's final answer (`\\boxed{}` or `####`) equals the reference's, else 0."""
    predicted = extract_answer(response)
    reference = extract_answer(answer) or answer
    return float(predicted is not None and equivalent(predicted, reference))


BUILT_IN: dict[str, RewardFn] = {"default": default_task.reward, "math": math_exact}


def load_reward(spec: str) -> RewardFn:
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


def score(fn: RewardFn, prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """Rewards of every sample; a reward function that raises or returns a non-number is reported with the sample."""
    rewards = []
    for i, (prompt, response, answer) in enumerate(zip(prompts, responses, answers, strict=True)):
        try:
            value = fn(prompt, response, answer)
        except Exception as e:
            raise TrainerError(
                f"the reward function raised {type(e).__name__}: {e} on sample {i}: "
                f"prompt={prompt!r}, response={response!r}, answer={answer!r}"
            ) from e
        if not isinstance(value, numbers.Real) or (isinstance(value, float) and math.isnan(value)):
            raise TrainerError(f"the reward function returned {value!r} (not a number) on sample {i}: "
                               f"prompt={prompt!r}, response={response!r}, answer={answer!r}")  # fmt: skip
        rewards.append(float(value))
    return rewards

"""verifiers environments built from its own classes, for the tests (`env.verifiers.id=<this file>:load_...`): a
`ToolEnv` with a tool (the calculator's `mul`) and a `MultiTurnEnv` with feedback, each scored by a `Rubric` with two
weighted functions. The texts they write are spelled in the calculator model's vocabulary."""

import re

import verifiers as vf
from datasets import Dataset

from lorarl.trainer.calculator_task import mul

ROWS = [{"prompt": [{"role": "user", "content": "123*45"}], "answer": "5535"}]


def correct(completion, answer) -> float:
    """1 when the last message holds the answer."""
    return float(answer in (completion[-1].get("content") or ""))


def called(completion) -> float:
    """1 when a tool ran."""
    return float(any(m["role"] == "tool" for m in completion))


def turns(state) -> float:
    """The number of model turns."""
    return float(len(state["trajectory"]))


CALCULATOR_WEIGHTS = (1.0, 0.25)
FEEDBACK_WEIGHTS = (1.0, -0.1)


def load_calculator(max_turns: int = 3) -> vf.ToolEnv:
    """The model multiplies with a `mul` tool: correct (1.0) + called a tool (0.25)."""
    rubric = vf.Rubric(funcs=[correct, called], weights=list(CALCULATOR_WEIGHTS))
    return vf.ToolEnv(dataset=Dataset.from_list(ROWS), tools=[mul], max_turns=max_turns, rubric=rubric)


class Feedback(vf.MultiTurnEnv):
    """Each wrong answer gets "error" back; the answer ends the rollout."""

    async def env_response(self, messages, state, **kwargs):
        if state["answer"] in re.findall(r"\d+", messages[-1]["content"] or ""):
            state["final_env_response"] = []
            return []
        return [{"role": "user", "content": "error"}]


def load_feedback(max_turns: int = 3) -> Feedback:
    """Answer, with feedback after each wrong one: correct (1.0) − 0.1 per turn."""
    rubric = vf.Rubric(funcs=[correct, turns], weights=list(FEEDBACK_WEIGHTS))
    return Feedback(dataset=Dataset.from_list(ROWS), max_turns=max_turns, rubric=rubric)

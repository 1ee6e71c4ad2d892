"""verifiers environments, unchanged (`env=verifiers`, the `verifiers` extra), played token-exactly. (With verifiers
>= 0.4, which keeps only its v1 stack, `env=verifiers` plays v1 tasksets: `verifiers_v1.py`.)

A verifiers environment plays its own rollout against an OpenAI client and records each turn's token ids and log-probs
in `state["trajectory"]`. Its classes are `SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv` and `StatefulToolEnv`, scored by
a `Rubric`. Here each episode is that rollout, run against lorarl's in-process client (`openai_client.py`), so the
trajectory holds the engine's own ids and log-probs.

`env.verifiers.id` names the environment. It is either an installed environment's id, loaded with
`vf.load_environment(id, **env.verifiers.args)`, or an import path to a `vf.Environment` or to a function that returns
one. A data row is verifiers' own: `prompt` (messages), `answer`, `info` and `task`. Save the environment's `dataset`
as parquet, or with `save_to_disk`, and lorarl reads it as it is.

The episodes of one data row (`rollout.n`) are scored together by the environment's rubric (`score_group`, as verifiers'
`run_group` does) once all have ended. The reward is the rubric's weighted sum, and each of its functions is logged as
`env/<name>`. The engine samples with `rollout.*`; of a request's sampling arguments only `stop` applies.
"""

from __future__ import annotations

import copy
import functools
import json

from lorarl.trainer.envs.openai_client import ClientEnvironment
from lorarl.trainer.envs.scheduling import event_loop
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.registry import import_object

try:
    import verifiers as vf
except ImportError:
    raise TrainerError("env=verifiers needs the verifiers extra: uv sync --extra verifiers (in lorarl's workspace), "
                       "or pip install 'lorarl-trainer[verifiers]'") from None  # fmt: skip


@functools.cache
def load(spec: str, args: str) -> vf.Environment:
    """The environment `env.verifiers.id` names, made with the keyword arguments `args` (JSON)."""
    kwargs = json.loads(args)
    try:
        if ":" in spec:
            found = import_object(spec)
            environment = found if isinstance(found, vf.Environment) else found(**kwargs)
        else:
            environment = vf.load_environment(spec, **kwargs)
    except Exception as e:
        raise TrainerError(f"env.verifiers.id={spec!r}: cannot load the environment: {type(e).__name__}: {e}") from None
    if not isinstance(environment, vf.Environment):
        raise TrainerError(f"env.verifiers.id={spec!r} gave a {type(environment).__name__}, expected a verifiers "
                           "Environment (or a function returning one)")  # fmt: skip
    if environment.message_type != "chat":
        raise TrainerError(f"env.verifiers.id={spec!r}: a {environment.message_type!r} environment; lorarl plays chat "
                           "environments (message_type='chat')")  # fmt: skip
    return environment


class ClassicVerifiersEnvironment(ClientEnvironment):
    """One rollout of the run's verifiers environment."""

    @property
    def environment(self) -> vf.Environment:
        return load(self.settings.id, json.dumps(dict(self.settings.args), sort_keys=True))

    def program(self, example, client):
        columns = example.columns
        rollout_input = {"prompt": self.start(example), "answer": example.answer or "",
                         "task": columns.get("task") or self.environment.env_id or "default",
                         "info": columns.get("info") or {}, "example_id": columns.get("example_id", 0)}  # fmt: skip
        sampling_args = {**copy.deepcopy(self.environment.sampling_args), "logprobs": True}
        return self.environment.rollout(rollout_input, client, "lorarl", sampling_args)

    def outcome(self) -> str:
        return (self.result or {}).get("stop_condition") or "done"

    @classmethod
    def conclude(cls, groups) -> None:
        super().conclude(groups)
        for group in groups:
            scored = [e for e in group if e.env.result is not None]
            if not scored:
                continue
            states = [e.env.result for e in scored]
            event_loop().run_until_complete(scored[0].env.environment.rubric.score_group(states))
            for episode, state in zip(scored, states, strict=True):
                episode.env.reward = float(state["reward"])
                episode.count(state.get("metrics") or {})

    def final_reward(self) -> float:
        return getattr(self, "reward", 0.0)


if hasattr(vf, "Environment"):
    VerifiersEnvironment = ClassicVerifiersEnvironment
else:  # verifiers >= 0.4 keeps only its v1 stack
    from lorarl.trainer.envs import verifiers_v1

    VerifiersEnvironment = verifiers_v1.VerifiersV1Environment

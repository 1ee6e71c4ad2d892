"""The environment protocol, at the token level: what an episode is to the trainer.

An episode starts from an observation — the token ids the engine continues from — and alternates: the engine samples
an action (token ids), the environment answers with a reward and either the end of the episode or the next
observation. The next observation is the whole context of the next turn; where it extends the previous context by the
sampled action, the episode stays one training sequence (what the environment appended gets mask 0); where it does not
(a template that rewrites its history), a new training sample starts there — never a sequence the engine did not see.

Token ids are the truth: the trainer trains on exactly the ids the engine sampled, never on a decode → encode round
trip of them (`Action.text` is for parsing only). The message-level layer (`chat.py`) builds on this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lorarl.trainer.data import Example


@dataclass(frozen=True)
class Observation:
    """The context the engine continues from (prompt and everything since, in token ids), and the strings that end
    the next action besides the end-of-sequence token (the end of a tool call)."""

    tokens: tuple[int, ...]
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Action:
    """What the engine sampled in one turn: its token ids, their text (decoded once, for parsing), whether it ended
    on the end-of-sequence token (`eos`) or a stop string (`stopped`), rather than being cut at a length, and the
    engine's log-probs of its tokens."""

    tokens: tuple[int, ...]
    text: str
    eos: bool
    stopped: bool
    logprobs: tuple[float, ...] = ()

    @property
    def finished(self) -> bool:
        return self.eos or self.stopped


@dataclass(frozen=True)
class Step:
    """The environment's answer to an action: the turn's reward; with `done`, why the episode ended (`stop_reason`);
    otherwise the next observation. `metrics` are counted per episode (`env/<name>`, summed over its turns)."""

    reward: float = 0.0
    done: bool = False
    observation: Observation | None = None
    stop_reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if not self.done and self.observation is None:
            raise ValueError("a step that does not end the episode needs the next observation")


@dataclass(frozen=True)
class EnvSetup:
    """What an environment is built with: the policy's tokenizer, the `env` section, its own settings
    (`env.<name>.*`, None if it has none), the run's tools and `data.system_prompt`."""

    tokenizer: Any
    section: Any
    settings: Any = None
    tools: tuple = ()
    system_prompt: str | None = None


class Environment:
    """One episode's environment at the token level. Subclass and implement `reset` and `step`; register it with
    `@register_env("name", settings=...)` (or name it by import path, `env.name=my.py:MyEnv`). One instance serves one
    episode: state kept on `self` is the episode's."""

    def __init__(self, setup: EnvSetup):
        self.setup = setup
        self.tokenizer, self.settings, self.tools = setup.tokenizer, setup.settings, setup.tools

    def reset(self, example: Example) -> Observation:
        """The episode's first observation, from its data row (`example.prompt`, `.answer`, `.columns`)."""
        raise NotImplementedError

    def step(self, action: Action) -> Step:
        """The answer to the engine's `action`."""
        raise NotImplementedError

    steps_truncated: bool = False  # whether an action cut at a length is stepped too (SkyRL's generator does)
    owns_data: bool = False  # whether it can make its episodes' tasks itself, from rows of an empty prompt

    def final_reward(self) -> float:
        """A reward for the whole episode, read once it has ended, however it ended (TRL's `get_reward`)."""
        return 0.0

    def reward_columns(self) -> dict:
        """Fields the reward functions get beside the data row's, for this episode (TRL's `environments`)."""
        return {}

    def conversation(self, actions: list[Action]) -> tuple[list[dict], list[dict]]:
        """The ended episode (its `actions`) as chat messages, for TRL's reward functions: its prompt, and what came
        after it. None at the token level: no messages."""
        return [], []

    @classmethod
    def check_examples(cls, examples: list) -> None:
        """The run's data rows (`data.Example`), checked once they have loaded: raise `TrainerError` naming a row this
        environment cannot play, before any episode starts."""

    @classmethod
    def conclude(cls, groups: list[list]) -> None:
        """A batch's episodes (`episodes.Episode`) once every one has ended, grouped by data row: for what an
        environment does with a whole group (a rubric that scores a group together) or with how an episode ended (a
        last action cut at a length, which no `step` sees)."""

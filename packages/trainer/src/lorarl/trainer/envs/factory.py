"""TRL's `environment_factory` classes, unchanged, as lorarl environments.

A TRL environment is a class with `reset(**row)`, which starts an episode from its data row (a string it returns is
appended to the last prompt message), and public methods that are the model's tools (schemas from their type hints
and Google-style docstrings, as TRL reads them); an optional `get_reward()` scores the ended episode from its state —
TRL's reward of weight 1 beside the reward functions, here a reward the episode's return includes. `env.name=
my_module:MyEnv` names one: a class with a `reset` that is not an lorarl `Environment` is played one instance per
episode, its tools called in the run's `env.tool_format`, beside `env.tools` (TRL's `tools=`). Reward functions written
for TRL get `environments=[...]`, one instance per response, as TRL passes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace

from lorarl.trainer.envs.base import Environment
from lorarl.trainer.envs.tools import Tool, ToolEnvironment

RESERVED = ("reset", "get_reward")  # TRL's methods that are not tools


def is_factory(found: object) -> bool:
    """A TRL-style environment class: one with a `reset`, not an lorarl `Environment`."""
    return (isinstance(found, type) and not issubclass(found, Environment)
            and callable(getattr(found, "reset", None)))  # fmt: skip


def factory_environment(factory: type) -> type[FactoryEnvironment]:
    """The lorarl environment that plays `factory`'s episodes. Its tools are read here, from one instance (as TRL
    probes it): a method that cannot be a tool is named when the run is configured, and each episode only binds the
    schemas to its own instance."""
    return type(f"Factory[{factory.__name__}]", (FactoryEnvironment,),
                {"factory": factory, "methods": tuple(tools_of(factory()))})  # fmt: skip


def tools_of(instance: object) -> list[Tool]:
    """`instance`'s tools: its class's public methods but TRL's reserved ones, bound to it."""
    names = [name for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
             if not name.startswith("_") and name not in RESERVED]  # fmt: skip
    return [Tool.from_function(getattr(instance, name), f"{type(instance).__name__}.{name}", key="env.name")
            for name in names]  # fmt: skip


class FactoryEnvironment(ToolEnvironment):
    """One episode of a TRL environment: its instance, made and reset when the episode starts."""

    factory: Callable[[], object]
    methods: tuple[Tool, ...]  # the class's tools, bound to the probed instance

    def start(self, example) -> list[dict]:
        messages = super().start(example)
        self.instance = self.factory()
        own = (replace(tool, fn=getattr(self.instance, tool.name)) for tool in self.methods)
        self.tools = (*self.setup.tools, *own)
        observation = self.instance.reset(**{"prompt": example.prompt, "answer": example.answer, **example.columns})
        if observation is not None:
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
        return messages

    def final_reward(self) -> float:
        get_reward = getattr(self.instance, "get_reward", None)
        return float(get_reward()) if callable(get_reward) else 0.0

    def reward_columns(self) -> dict:
        return {"environments": self.instance}

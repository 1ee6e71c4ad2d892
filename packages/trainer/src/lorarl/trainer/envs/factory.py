"""TRL's `environment_factory` classes, unchanged, as lorarl environments.

A TRL environment is a class with `reset(**row)`, which starts an episode from its data row — every field of it, the
prompt included, as TRL passes them — (a string it returns is appended to the last prompt message), and public methods
that are the model's tools (schemas from their type hints and Google-style docstrings, as TRL reads them); an optional
`get_reward()` scores the ended episode from its state — TRL's reward of weight 1 beside the reward functions, here a
reward the episode's return includes. `env.name=my_module:MyEnv` names one: a class with a `reset` that is not an
lorarl `Environment` is played one instance per episode, its tools called in the run's `env.tool_format`, beside
`env.tools` (TRL's `tools=`). A dict of such classes (`env.name=my_module:ENVIRONMENTS`, TRL's `environment_factory=
{"coding": CodingEnv, "game": GameEnv}`) has each row's `environment` field choose its class; that field is not
passed to `reset`, and a row offers only its class's tools. Reward functions written for TRL get `environments=[...]`,
one instance per response, as TRL passes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import replace

from lorarl.trainer.envs.base import Environment
from lorarl.trainer.envs.tools import Tool, ToolEnvironment
from lorarl.trainer.errors import TrainerError

RESERVED = ("reset", "get_reward")  # TRL's methods that are not tools
ROUTE = "environment"  # the row field that chooses among a dict of environments


def _is_class(found: object) -> bool:
    return (isinstance(found, type) and not issubclass(found, Environment)
            and callable(getattr(found, "reset", None)))  # fmt: skip


def is_factory(found: object) -> bool:
    """A TRL-style environment class (one with a `reset`, not an lorarl `Environment`), or a dict of them by name."""
    if isinstance(found, Mapping):
        return bool(found) and all(isinstance(k, str) and _is_class(v) for k, v in found.items())
    return _is_class(found)


def factory_environment(factory: type | Mapping[str, type]) -> type[FactoryEnvironment]:
    """The lorarl environment that plays `factory`'s episodes (a class, or a dict of classes by name). Their tools are
    read here, from one instance of each (as TRL probes them): a method that cannot be a tool is named when the run is
    configured, and each episode only binds the schemas to its own instance."""
    factories = dict(factory) if isinstance(factory, Mapping) else {None: factory}
    name = "|".join(f.__name__ for f in factories.values())
    return type(f"Factory[{name}]", (FactoryEnvironment,),
                {"factories": factories, "methods": {key: tuple(tools_of(f())) for key, f in factories.items()}})


def tools_of(instance: object) -> list[Tool]:
    """`instance`'s tools: its class's public methods but TRL's reserved ones, bound to it."""
    names = [name for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
             if not name.startswith("_") and name not in RESERVED]  # fmt: skip
    return [Tool.from_function(getattr(instance, name), f"{type(instance).__name__}.{name}", key="env.name")
            for name in names]  # fmt: skip


class FactoryEnvironment(ToolEnvironment):
    """One episode of a TRL environment: its instance, made and reset when the episode starts. Without data
    (`data.train_files=[]`, TRL's `train_dataset=None`) each row is an empty prompt that `reset` fills in."""

    owns_data = True

    factories: dict[str | None, Callable[[], object]]  # by name (None: the one class of a single factory)
    methods: dict[str | None, tuple[Tool, ...]]  # each class's tools, bound to its probed instance

    @classmethod
    def check_examples(cls, examples: list) -> None:
        """A dict of environments: every row's `environment` names one of them."""
        for example in examples:
            cls._chosen(example, example.row())

    @classmethod
    def _chosen(cls, example, row: dict) -> str | None:
        """The key of the environment `example` is played in (popped from its `row`: `reset` does not get it)."""
        if None in cls.factories:
            return None
        key = row.pop(ROUTE, None)  # a dict: the row chooses
        if key not in cls.factories:
            raise TrainerError(f"{example.where}: {ROUTE}={key!r} is not one of the environments "
                               f"{sorted(cls.factories)}")  # fmt: skip
        return key

    def start(self, example) -> list[dict]:
        messages = super().start(example)
        row = example.row()
        key = self._chosen(example, row)
        self.instance = self.factories[key]()
        own = [replace(tool, fn=getattr(self.instance, tool.name)) for tool in self.methods[key]]
        shadowed = sorted({t.name for t in own} & {t.name for t in self.setup.tools})
        if shadowed:
            raise TrainerError(f"env.tools: {shadowed} share their names with methods of "
                               f"{type(self.instance).__name__}, its tools: rename one or the other")  # fmt: skip
        self.tools = (*self.setup.tools, *own)
        observation = self.instance.reset(**row)
        if observation is not None:
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
        return messages

    def final_reward(self) -> float:
        get_reward = getattr(self.instance, "get_reward", None)
        return float(get_reward()) if callable(get_reward) else 0.0

    def reward_columns(self) -> dict:
        return {"environments": self.instance}

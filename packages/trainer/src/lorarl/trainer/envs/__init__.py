"""Multi-turn environments: the model acts, the environment answers, over several turns — trained on exactly the
tokens the engine sampled (`base.py`: the token-level protocol; `chat.py`: the message level, through the tokenizer's
chat template; `tools.py`: tools from Python functions; `episodes.py`: running a batch of episodes on the engine and
turning them into training samples).

The choices of `env.name`: `none` (single-turn: one response per prompt), `tools` (the model calls `env.tools`), or a
plugin's `Environment` subclass by import path (`env.name=my.py:MyEnv`), registered with `@register_env("name",
settings=...)` to give it settings of its own (`env.<name>.*`) — or left undecorated.
"""

from dataclasses import dataclass

from lorarl.trainer.registry import Plugin, PluginError, Registry, import_object, option

SINGLE_TURN = "none"


@dataclass(frozen=True)
class Env(Plugin):
    """A registered environment: `target` is its `Environment` subclass, or (built-ins) its import path, imported when
    a run starts (the configuration reads this registry without importing torch)."""

    about: str = ""

    @property
    def environment(self) -> type:
        from lorarl.trainer.envs.base import Environment

        found = import_object(self.target) if isinstance(self.target, str) else self.target
        if not (isinstance(found, type) and issubclass(found, Environment)):
            raise PluginError(f"env.name={self.origin!r} is a {type(found).__name__}, expected a subclass of "
                              "lorarl.trainer.envs.Environment (or ChatEnvironment)")  # fmt: skip
        return found

    @property
    def summary(self) -> str:
        return self.about or super().summary


class Environments(Registry[Env]):
    """The environment registry; an import path may also name an undecorated `Environment` subclass."""

    def _load(self, spec: str) -> Env:
        try:
            return super()._load(spec)
        except PluginError:
            found = import_object(spec)
            from lorarl.trainer.envs.factory import factory_environment, is_factory

            if is_factory(found):  # TRL's environment_factory class
                return Env(name=spec, target=factory_environment(found))
            if not isinstance(found, type):
                raise PluginError(f"{spec} is a {type(found).__name__}, expected a subclass of "
                                  "lorarl.trainer.envs.Environment (or ChatEnvironment)") from None  # fmt: skip
            entry = Env(name=spec, target=found)
            entry.environment  # noqa: B018 (checks the class)
            return entry


ENVIRONMENTS = Environments("environment", Env, keywords={SINGLE_TURN: "single-turn: one response per prompt"})
register_env = ENVIRONMENTS.register
register_env("tools", about="the model answers the prompt calling env.tools (results fed back as tool messages)")(
    "lorarl.trainer.envs.tools:ToolEnvironment"
)


@dataclass
class SkyRLGymSettings:
    """SkyRL's `environment.skyrl_gym` section: the id, and the `env_config` of the environments SkyRL configures."""

    id: str = option("gsm8k", "the SkyRL-gym environment (skyrl_gym.make's id: gsm8k, gsm8k_multi_turn, aime, "
                     "text2sql, search, lcb, …) for rows without an env_class")  # fmt: skip
    text2sql: dict = option({"db_path": "/home/ray/default/sql_data"}, "text2sql's env_config: db_path, the folder "
                            "of its databases (<db_path>/spider/database/<db_id>/<db_id>.sqlite, ...)")  # fmt: skip
    search: dict = option({"log_requests": False, "search_url": "http://127.0.0.1:8000/retrieve", "topk": 3,
                           "timeout": 30}, "search's env_config: its retrieval server, results, timeout")  # fmt: skip
    llm_as_a_judge: dict = option({"model": "gpt-4o-mini", "base_url": None}, "llm_as_a_judge's env_config: the "
                                  "judge model and its OpenAI-compatible server")  # fmt: skip


register_env("skyrl_gym", settings=SkyRLGymSettings,
             about="SkyRL-gym's registered environments (the skyrl-gym extra): env.skyrl_gym.id, or a row's env_class")(
    "lorarl.trainer.envs.skyrl:SkyRLGymEnvironment"
)  # fmt: skip


@dataclass
class VerifiersSettings:
    id: str = option("", "the verifiers environment: an installed one's id (vf.load_environment), or an import path "
                     "(module:name, path/to/file.py:name) to a vf.Environment or a function returning one; with "
                     "verifiers >= 0.4 (its v1 stack), a taskset's id or importable module")  # fmt: skip
    args: dict = option({}, "keyword arguments of load_environment (or of the function env.verifiers.id names); v1: "
                        "the taskset config's fields")  # fmt: skip
    config: dict = option({}, "v1: the rest of verifiers' env config (agent: harness, runtime, max_turns, ...; the "
                          "runtime defaults to a local subprocess, the harness to the taskset's or else "
                          "null)")  # fmt: skip
    renderer: dict = option({}, "v1: the renderers config its train client renders chat with (name: default — the "
                            "tokenizer's chat template —, qwen3, llama-3, ...; tool_parser: qwen3, ... for tool "
                            "calls)")  # fmt: skip


register_env("verifiers", settings=VerifiersSettings,
             about="verifiers environments, unchanged (the verifiers extra): env.verifiers.id, env.verifiers.args")(
    "lorarl.trainer.envs.verifiers_env:VerifiersEnvironment"
)  # fmt: skip

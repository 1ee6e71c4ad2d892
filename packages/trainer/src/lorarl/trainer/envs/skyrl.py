"""SkyRL-gym's registered environments (`env=skyrl_gym`, the `skyrl-gym` extra), played token-exactly.

A SkyRL-gym environment is text in, messages out: `init(prompt messages) -> (messages, info)`, then `step(action
text) -> {observations, reward, done, metadata}`, made by `skyrl_gym.make(id, env_config=..., extras=row)`. Here it is
a chat environment: its observations are rendered after each action as the template renders them (as SkyRL's own
generator appends them), each step's reward is the turn's. As SkyRL's generator does:
- a data row is SkyRL's: `env_class` (else `env.skyrl_gym.id`), and every other field but the prompt — `reward_spec`
  (else `{"method": "rule", "ground_truth": <answer>}`), `extra_info`, a SQL row's `db_id` and `data` — a copy of them
  per episode as the environment's `extras`, with `max_turns` = `env.max_turns`;
- `env_config` is `env.skyrl_gym.<env id>` (SkyRL's `environment.skyrl_gym.<env id>`: text2sql's `db_path`,
  search's `search_url`, ...), read by attribute;
- an action cut at `rollout.max_tokens` is stepped too, and the episode goes on unless the environment ends it.
"""

from __future__ import annotations

import copy
import socket
import urllib.parse

from lorarl.trainer.envs.chat import ChatEnvironment, Reply
from lorarl.trainer.errors import TrainerError

try:
    import skyrl_gym
except ImportError:
    raise TrainerError("env=skyrl_gym needs the skyrl-gym extra: uv sync --extra skyrl-gym (in lorarl's workspace), "
                       "or pip install 'lorarl-trainer[skyrl-gym]'") from None  # fmt: skip


_answering: dict[str, str] = {}  # a service's URL: "" where it answers, else why not


def check_services(env_id: str, env_config: dict) -> None:
    """The services an environment's `env_config` names (`*_url`: search's retrieval server) accept connections, or
    one line naming the key: SkyRL retries a call to one that does not for about 45 s, then hands the model the error
    text as its observation, and the run goes on learning nothing. Checked once per URL."""
    for field, url in env_config.items():
        if not (field.endswith("_url") and isinstance(url, str) and url.startswith(("http://", "https://"))):
            continue
        if url not in _answering:
            parts = urllib.parse.urlsplit(url)
            try:
                port = parts.port or (443 if parts.scheme == "https" else 80)
                socket.create_connection((parts.hostname, port), timeout=5).close()
                _answering[url] = ""
            except OSError as e:
                _answering[url] = f"{type(e).__name__}: {e}"
        if _answering[url]:
            raise TrainerError(f"env.skyrl_gym.{env_id}.{field}={url}: nothing answers there ({_answering[url]}); "
                               f"SkyRL's {env_id} environment calls it every turn: start it, or point the key at "
                               "it")  # fmt: skip


class SkyRLGymEnvironment(ChatEnvironment):
    """One episode of a SkyRL-gym environment."""

    steps_truncated = True

    def start(self, example) -> list[dict]:
        from omegaconf import OmegaConf

        columns = copy.deepcopy(example.columns)
        env_id = columns.pop("env_class", None) or self.settings.id
        extras = {"reward_spec": {"method": "rule", "ground_truth": example.answer}, "extra_info": {}, **columns,
                  "max_turns": self.setup.section.max_turns}  # fmt: skip
        env_config = getattr(self.settings, env_id, None) or {}
        check_services(env_id, env_config)
        self.gym = skyrl_gym.make(env_id, env_config=OmegaConf.create(env_config), extras=extras)
        messages, _ = self.gym.init(super().start(example))
        return list(messages)

    def respond(self, message: dict) -> Reply:
        out = self.gym.step(message["content"])
        reward = float(out["reward"] or 0.0)
        if out["done"]:
            self.gym.close()
            return Reply(reward=reward, done=True, stop_reason="done")
        return Reply(list(out["observations"]), reward=reward)

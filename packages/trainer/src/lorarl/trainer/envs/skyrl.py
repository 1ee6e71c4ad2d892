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

from lorarl.trainer.envs.chat import ChatEnvironment, Reply
from lorarl.trainer.errors import TrainerError

try:
    import skyrl_gym
except ImportError:
    raise TrainerError("env=skyrl_gym needs the skyrl-gym extra: uv sync --extra skyrl-gym (in lorarl's workspace), "
                       "or pip install 'lorarl-trainer[skyrl-gym]'") from None  # fmt: skip


class SkyRLGymEnvironment(ChatEnvironment):
    """One episode of a SkyRL-gym environment."""

    steps_truncated = True

    def start(self, example) -> list[dict]:
        from omegaconf import OmegaConf

        columns = copy.deepcopy(example.columns)
        env_id = columns.pop("env_class", None) or self.settings.id
        extras = {"reward_spec": {"method": "rule", "ground_truth": example.answer}, "extra_info": {}, **columns,
                  "max_turns": self.setup.section.max_turns}  # fmt: skip
        env_config = OmegaConf.create(getattr(self.settings, env_id, None) or {})
        self.gym = skyrl_gym.make(env_id, env_config=env_config, extras=extras)
        messages, _ = self.gym.init(super().start(example))
        return list(messages)

    def respond(self, message: dict) -> Reply:
        out = self.gym.step(message["content"])
        reward = float(out["reward"] or 0.0)
        if out["done"]:
            self.gym.close()
            return Reply(reward=reward, done=True, stop_reason="done")
        return Reply(list(out["observations"]), reward=reward)

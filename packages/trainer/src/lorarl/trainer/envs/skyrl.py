"""SkyRL-gym's registered environments (`env=skyrl_gym`, the `skyrl-gym` extra), played token-exactly.

A SkyRL-gym environment is text in, messages out: `init(prompt messages) -> (messages, info)`, then `step(action
text) -> {observations, reward, done, metadata}`, made by `skyrl_gym.make(id, env_config=..., extras=row)`. Here it is
a chat environment: its observations are rendered after each action as the template renders them (as SkyRL's own
generator appends them), each step's reward is the turn's. A data row is SkyRL's: `env_class` (else
`env.skyrl_gym.id`), `reward_spec` (else `{"method": "rule", "ground_truth": <answer>}`), `extra_info`, and any other
field, all handed over as the environment's `extras`.
"""

from __future__ import annotations

from lorarl.trainer.envs.chat import ChatEnvironment, Reply
from lorarl.trainer.errors import TrainerError

try:
    import skyrl_gym
except ImportError:
    raise TrainerError("env=skyrl_gym needs the skyrl-gym extra: uv sync --extra skyrl-gym (in lorarl's workspace), "
                       "or pip install 'lorarl-trainer[skyrl-gym]'") from None  # fmt: skip


class SkyRLGymEnvironment(ChatEnvironment):
    """One episode of a SkyRL-gym environment."""

    def start(self, example) -> list[dict]:
        columns = dict(example.columns)
        env_id = columns.pop("env_class", None) or self.settings.id
        extras = {"reward_spec": {"method": "rule", "ground_truth": example.answer}, "extra_info": {}, **columns}
        self.gym = skyrl_gym.make(env_id, env_config=None, extras=extras)
        messages, _ = self.gym.init(super().start(example))
        return list(messages)

    def respond(self, message: dict) -> Reply:
        out = self.gym.step(message["content"])
        reward = float(out["reward"] or 0.0)
        if out["done"]:
            self.gym.close()
            return Reply(reward=reward, done=True, stop_reason="done")
        return Reply(list(out["observations"]), reward=reward)

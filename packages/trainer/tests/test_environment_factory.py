"""TRL's `environment_factory` classes run unchanged (`env=module:Class`): TRL's documented `IncrementEnv` — its
`reset(**row)` appended to the last prompt message, its public methods the model's tools, `get_reward()` in the
episode's return, `environments=` handed to TRL-style reward functions — and a run trains on them."""

import pytest
from chat_fixtures import chat_model_dir, hermes_call, qwen2_style_tokenizer, train_two_steps
from test_multiturn import Script, pieces

from lorarl.trainer.config import load_config
from lorarl.trainer.data import Example
from lorarl.trainer.engines import SamplingParams
from lorarl.trainer.envs.episodes import EpisodeRunner
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.rollout import episode_returns, final_responses
from lorarl.trainer.scoring import Rewards

# TRL's documentation (GRPOTrainer, environment_factory), its dataset-driven variant: the row's `target` column
TRL_ENV = '''
class IncrementEnv:
    def reset(self, target, **kwargs) -> str | None:
        self.counter = 0
        self.target = target
        return f" Increment the counter by {target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter

    def _helper(self):  # private: not a tool
        return None


class AsyncIncrementEnv(IncrementEnv):
    async def double(self) -> int:
        """
        Double the counter (an async tool, as TRL allows).

        Returns:
            The updated counter value.
        """
        self.counter *= 2
        return self.counter


def counter_reward(completions, environments, **kwargs) -> list[float]:
    """A TRL reward function reading the environments: how close each counter came."""
    return [-abs(env.counter - env.target) / 10 for env in environments]
'''

ROW = Example("Start.", "", (), {"target": 3}, "train.jsonl line 1")


def plugin(tmp_path):
    path = tmp_path / "increment.py"
    path.write_text(TRL_ENV)
    return path


def test_a_trl_environment_plays_episodes_with_its_tools_and_rewards(tmp_path):
    spec = f"{plugin(tmp_path)}:AsyncIncrementEnv"
    config = load_config(None, [f"env={spec}", "env.tool_format=hermes"])
    tok = qwen2_style_tokenizer()
    run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
    episodes = run.start([ROW, ROW], 1)
    right = [pieces(hermes_call("increment", {"step": 3}), tok), [*pieces("done", tok), "<|im_end|>"]]
    short = [
        pieces(hermes_call("increment", {"step": 1}), tok),
        pieces(hermes_call("double", {}), tok),
        [*pieces("done", tok), "<|im_end|>"],
    ]
    run.play(Script(tok, [right, short]), episodes, SamplingParams(max_tokens=64))
    first = episodes[0].env
    assert first.messages[0] == {"role": "user", "content": "Start. Increment the counter by 3."}
    assert [t.name for t in first.tools] == ["double", "increment"]  # public methods but reset and get_reward
    assert "Increment the internal counter." in tok.decode(list(episodes[0].prompt))  # offered through the template
    assert first.messages[2]["content"] == "3"  # the tool ran on this episode's instance
    assert [e.env.instance.counter for e in episodes] == [3, 2]  # 1, doubled by the async tool
    assert [e.stop_reason for e in episodes] == ["answer", "answer"]
    reward = Rewards(load_config(None, [f"reward.fns=[{plugin(tmp_path)}:counter_reward]"]).reward)
    scores = reward.score(final_responses(episodes, tok))
    assert [s.total for s in scores] == [0.0, -0.1]
    assert episode_returns(episodes, scores) == [1.0, -0.1]  # get_reward() (weight 1, as TRL) + the reward function


def test_a_method_that_cannot_be_a_tool_is_named_when_the_run_is_configured(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(
        "class Bad:\n    def reset(self, **row):\n        return None\n\n"
        "    def guess(self, n: int) -> str:\n        return str(n)\n"
    )
    with pytest.raises(TrainerError, match=r"env.name: 'Bad.guess' is not a usable tool .*no docstring"):
        load_config(None, [f"env={path}:Bad"])


def train_on_increment_env(tmp_path, model, *extra: str) -> list[dict]:
    """Two steps of a run on TRL's `IncrementEnv` and its reward function: the steps' metrics."""
    rows = [{"prompt": "Start.", "answer": "", "target": t} for t in range(1, 9)]
    path = plugin(tmp_path)
    return train_two_steps(tmp_path, model, rows, f"env={path}:IncrementEnv", "env.tool_format=hermes",
                           "env.max_tokens=48", "rollout.max_tokens=16", f"reward.fns=[{path}:counter_reward]",
                           *extra)  # fmt: skip


def test_a_run_trains_on_a_trl_environment(tmp_path):
    """Two steps on the HF engine: the engine's log-probs of the action tokens as the trainer recomputes them."""
    steps = train_on_increment_env(tmp_path, chat_model_dir(tmp_path / "model"))
    assert len(steps) == 2
    assert all(s["rollout/abs_logp_diff"] < 0.02 for s in steps)

"""TRL's `environment_factory` classes run unchanged (`env=module:Class`): TRL's documented `IncrementEnv` — its
`reset(**row)` appended to the last prompt message, its public methods the model's tools, `get_reward()` in the
episode's return, `environments=` handed to TRL-style reward functions — and a run trains on them."""

import json

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


# Written as TRL's documentation writes them (GRPOTrainer's "Agent Training" and OpenEnv's quick start): a `reset`
# taking the row's columns by name and no **kwargs, a prompt-only `datasets.Dataset` held in the script, reward
# functions that take `environments` and **kwargs, one that counts the `tool` messages of each completion, and a dict of
# environments routed by each row's `environment` field
TRL_STYLE = '''
from datasets import Dataset

dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Reach {t}."}] for t in range(1, 9)],
                             "target": list(range(1, 9))})


class CounterEnv:
    def reset(self, prompt, target) -> str | None:
        self.seen = {"prompt": prompt, "target": target}
        self.counter, self.target = 0, target
        return None

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.
        """
        self.counter += step
        return self.counter


class DownEnv(CounterEnv):
    def decrement(self, step: int) -> int:
        """
        Decrement the internal counter.

        Args:
            step: Value to take from the counter.
        """
        self.counter -= step
        return self.counter


class FreeEnv(CounterEnv):
    def reset(self, **kwargs) -> str | None:
        self.seen = kwargs
        self.counter, self.target = 0, kwargs["target"]
        return f"Reach {self.target}."


ENVIRONMENTS = {"up": CounterEnv, "down": DownEnv, "free": FreeEnv}
SEEN = {}


def reward_func(environments, **kwargs):
    return [float(env.counter == env.target) for env in environments]


def tool_messages(completions, trainer_state, **kwargs):
    SEEN.update(completions=completions, global_step=trainer_state.global_step, max_steps=trainer_state.max_steps)
    return [float(sum(m["role"] == "tool" for m in c)) for c in completions]
'''


def trl_style(tmp_path):
    path = tmp_path / "trl_style.py"
    path.write_text(TRL_STYLE)
    return path


def test_trl_environments_and_rewards_get_what_trl_passes_them(tmp_path):
    """`reset(**row)` gets exactly the row's columns, prompt included (no answer: the row has none); a reward
    function gets the episode's whole exchange as `completions`, in TRL's message shape, and `trainer_state`."""
    from lorarl.trainer.registry import import_object

    path = trl_style(tmp_path)
    config = load_config(None, [f"env={path}:CounterEnv", "env.tool_format=hermes"])
    tok = qwen2_style_tokenizer()
    run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
    prompt = [{"role": "user", "content": "Reach 2."}]
    row = Example(prompt, None, (), {"target": 2}, "trl_style.py:dataset row 2")
    (episode,) = run.start([row], 1)
    actions = [pieces(hermes_call("increment", {"step": 2}), tok), [*pieces("done", tok), "<|im_end|>"]]
    run.play(Script(tok, [actions]), [episode], SamplingParams(max_tokens=64))
    assert episode.env.instance.seen == {"prompt": prompt, "target": 2}
    reward = Rewards(load_config(None, [f"reward.fns=[{path}:reward_func,{path}:tool_messages]"]).reward, 5)
    reward.at_step(3)
    (score,) = reward.score(final_responses([episode], tok))
    assert score.parts == (1.0, 1.0)
    seen = import_object(f"{path}:SEEN")
    assert seen["completions"] == [[
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "increment", "arguments": {"step": 2}}}]},
        {"role": "tool", "content": "2", "name": "increment"},
        {"role": "assistant", "content": "done"},
    ]]  # fmt: skip
    assert (seen["global_step"], seen["max_steps"]) == (2, 5)  # TRL's state: the updates done before this step


def test_a_dict_of_trl_environments_is_routed_by_each_row(tmp_path):
    path = trl_style(tmp_path)
    config = load_config(None, [f"env={path}:ENVIRONMENTS", "env.tool_format=hermes"])
    tok = qwen2_style_tokenizer()
    run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
    rows = [Example("Reach 1.", None, (), {"target": 1, "environment": name}, f"row {i}")
            for i, name in enumerate(["up", "down"])]  # fmt: skip
    up, down = run.start(rows, 1)
    assert [t.name for t in up.env.tools] == ["increment"]  # a row offers its environment's tools alone
    assert [t.name for t in down.env.tools] == ["decrement", "increment"]
    assert "decrement" not in tok.decode(list(up.prompt))
    assert down.env.instance.seen == {"prompt": "Reach 1.", "target": 1}  # `environment` is not passed to reset
    with pytest.raises(TrainerError, match=r"row 9: environment='sideways' is not one of the environments"):
        run.start([Example("Reach 1.", None, (), {"target": 1, "environment": "sideways"}, "row 9")], 1)
    # a dataset that only routes (TRL's multi-environment example): no prompt column; reset gives the prompt
    from lorarl.trainer.data import PLACEHOLDER, Row, build_examples

    (routing,), _ = build_examples([Row("row 1", {"environment": "free", "target": 2})], tok, prompt_key="prompt",
                                   answer_key="auto", max_prompt_tokens=512, chat_template=True,
                                   default_prompt=list(PLACEHOLDER))  # fmt: skip
    (routed,) = run.start([routing], 1)
    assert routed.env.instance.seen == {"target": 2}  # neither the routing field nor a prompt the row did not have
    assert routed.env.messages[0]["content"] == "Reach 2."  # the placeholder's empty content, and what reset gave


def test_a_reward_that_takes_the_answer_refuses_data_without_one(tmp_path, capsys):
    from lorarl.trainer.cli import main

    path = trl_style(tmp_path)
    code = main([f"model.path={chat_model_dir(tmp_path / 'model')}", f"data.train_files={path}:dataset",
                 f"data.val_files={path}:dataset", f"env={path}:CounterEnv", "env.tool_format=hermes",
                 "trainer.steps=1", f"trainer.output_dir={tmp_path / 'out'}"])  # fmt: skip
    assert code == 2
    error = capsys.readouterr().out.strip().splitlines()[-1]
    assert error.startswith(f"error: {path}:dataset row 1: no answer ('answer', 'reward_model.ground_truth', "
                            "'reward_spec.ground_truth'; it has ['target']), which reward.fn='default' takes")


def test_a_row_naming_no_environment_of_the_dict_stops_the_run_when_the_data_loads(tmp_path, capsys):
    """Named in one line before the model loads, not when a step draws that row."""
    from lorarl.trainer.cli import main

    path, data = trl_style(tmp_path), tmp_path / "rows.jsonl"
    rows = [{"prompt": "Reach 1.", "target": 1, "environment": "up"}] * 3 + [{"prompt": "Reach 1.", "target": 1,
                                                                            "environment": "sideways"}]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code = main([f"model.path={chat_model_dir(tmp_path / 'model')}", f"data.train_files=[{data}]",
                 f"data.val_files=[{data}]", f"env={path}:ENVIRONMENTS", "env.tool_format=hermes",
                 f"reward.fns=[{path}:reward_func]", "data.batch_size=2", f"trainer.output_dir={out}"])  # fmt: skip
    assert code == 2
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == (f"error: {data}:4: environment='sideways' is not one of the environments ['down', "
                           "'free', 'up']")  # fmt: skip
    assert not out.exists()


def train_on_trl_style(tmp_path, model, *extra: str) -> list[dict]:
    """Two steps with the keys a TRL script's objects map to, and nothing else: the Dataset by import path, the
    environment class, the reward functions. The steps' metrics."""
    from lorarl.trainer.cli import main

    path, out = trl_style(tmp_path), tmp_path / "out"
    code = main([f"model.path={model}", f"data.train_files={path}:dataset", f"data.val_files={path}:dataset",
                 f"env={path}:CounterEnv", "env.tool_format=hermes",
                 f"reward.fns=[{path}:reward_func,{path}:tool_messages]", "data.batch_size=4", "rollout.n=2",
                 "rollout.max_tokens=16", "env.max_tokens=48", "trainer.steps=2", "trainer.eval_every=0",
                 f"trainer.output_dir={out}", *extra])  # fmt: skip
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_trains_on_trl_style_data_environments_and_rewards(tmp_path):
    steps = train_on_trl_style(tmp_path, chat_model_dir(tmp_path / "model"))
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["rollout/abs_logp_diff"] < 0.02 for s in steps)


# TRL's environment that owns its data (TRL's `train_dataset=None`): `reset` samples the task and returns the prompt,
# `get_reward` scores the episode from the environment's state
SELF_SAMPLING = '''
import random


class CountingEnv:
    def reset(self, **kwargs) -> str | None:
        self.seen = kwargs
        self.counter, self.target = 0, random.randint(1, 6)
        return f"Increment the counter by {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.
        """
        self.counter += step
        return self.counter
'''


def test_an_environment_that_makes_its_own_tasks_trains_without_data(tmp_path, capsys):
    """`data.train_files=[]`: rows of an empty prompt, each episode's `reset` filling it in, `get_reward` the
    return (`reward.fn=none`); without such an environment, empty data is refused in one line."""
    from lorarl.trainer.cli import main

    path, out = tmp_path / "counting.py", tmp_path / "out"
    path.write_text(SELF_SAMPLING)
    settings = [f"model.path={chat_model_dir(tmp_path / 'model')}", "data.train_files=[]", "data.val_files=[]",
                "env.tool_format=hermes", "reward.fn=none", "data.batch_size=4", "rollout.n=2",
                "rollout.max_tokens=16", "env.max_tokens=48", "trainer.steps=2", "trainer.eval_every=2"]  # fmt: skip
    assert main([*settings, f"env={path}:CountingEnv", f"trainer.output_dir={out}"]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert "val/accuracy" in steps[-1]
    config = load_config(None, [f"env={path}:CountingEnv", "env.tool_format=hermes"])
    tok = qwen2_style_tokenizer()
    run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
    (episode,) = run.start([Example([{"role": "user", "content": ""}], None, (), {}, "row 1")], 1)
    assert episode.env.messages[0]["content"].startswith("Increment the counter by ")  # the prompt reset gave
    assert episode.env.instance.seen == {"prompt": [{"role": "user", "content": ""}]}  # TRL's placeholder row
    capsys.readouterr()
    assert main([*settings, "env=tools", f"trainer.output_dir={tmp_path / 'refused'}"]) == 2
    assert "data.train_files is empty: name the data, or an environment that makes its own tasks" in (
        capsys.readouterr().out
    )

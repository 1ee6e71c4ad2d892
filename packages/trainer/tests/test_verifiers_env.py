"""verifiers environments run unchanged (`env=verifiers`): a `ToolEnv` with a tool and a `MultiTurnEnv` with
feedback, scored by `Rubric`s of two weighted functions, play their own rollouts against lorarl's in-process OpenAI
client — verifiers' recorded trajectory holds the engine's ids and log-probs, the training sample is those ids and
exactly what the template renders between them — and a run trains on them."""

from pathlib import Path

import pytest
import verifiers_envs
from chat_fixtures import train_two_steps
from test_multiturn import Script, pieces

from lorarl.trainer import default_task
from lorarl.trainer.calculator_task import build_tokenizer
from lorarl.trainer.config import load_config
from lorarl.trainer.data import Example
from lorarl.trainer.engines import SamplingParams
from lorarl.trainer.envs.episodes import EpisodeRunner
from lorarl.trainer.envs.openai_client import renderable
from lorarl.trainer.errors import ConfigError, TrainerError
from lorarl.trainer.rollout import episode_returns, final_responses
from lorarl.trainer.scoring import Rewards

FIXTURES = Path(verifiers_envs.__file__)
ROW = Example(verifiers_envs.ROWS[0]["prompt"], "5535", (), {"task": "mul"}, "train.jsonl line 1")
CALL = ["<call>", "mul", " ", "1", "2", "3", " ", "4", "5", "</call>"]


def play(loader: str, actions, n: int, *settings: str):
    tok = build_tokenizer()
    config = load_config(None, ["env=verifiers", f"env.verifiers.id={FIXTURES}:{loader}", "env.tool_format=compact",
                                "reward.fn=none", *settings])  # fmt: skip
    run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
    episodes = run.start([ROW] * (len(actions) // n), n)
    script = Script(tok, actions)
    run.play(script, episodes, SamplingParams(max_tokens=64))
    returns = episode_returns(episodes, Rewards(config.reward).score(final_responses(episodes, tok)))
    return tok, episodes, script, returns


def check_trajectory(tok, episode):
    """verifiers' record of each turn against the episode's one training sample: its prompt ids are the sample up to
    the turn, its completion ids and log-probs the engine's, and mask 1 falls on those ids alone."""
    (segment,) = episode.segments
    sequence, sampled = [*segment.prompt, *segment.tokens], [False] * len(segment.prompt) + segment.mask
    logprobs = [0.0] * len(segment.prompt) + segment.logprobs
    steps = episode.env.result["trajectory"]
    assert len(steps) == len(episode.actions)
    for step, action in zip(steps, episode.actions, strict=True):
        prompt, completion = step["tokens"]["prompt_ids"], step["tokens"]["completion_ids"]
        assert completion == list(action.tokens)
        end = len(prompt) + len(completion)
        assert sequence[:end] == prompt + completion
        assert step["tokens"]["completion_logprobs"] == logprobs[len(prompt) : end] == list(action.logprobs)
        assert all(sampled[len(prompt) : end])
    assert sum(sampled) == sum(len(a.tokens) for a in episode.actions)  # nothing else trains
    return sequence


def test_a_tool_env_plays_its_rollouts_on_the_engines_tokens():
    """A `ToolEnv` group of two: one calls `mul` and answers, one guesses. Each trajectory is the engine's tokens, the
    episode's sample is the template's rendering of verifiers' conversation, the rubric scores the group."""
    actions = [[CALL, [*pieces("5535", build_tokenizer()), "<eos>"]], [["5", "0", "0", "0", "<eos>"]]]
    tok, episodes, script, returns = play("load_calculator", actions, 2)
    environment = episodes[0].env.environment
    first = tok.apply_chat_template(verifiers_envs.ROWS[0]["prompt"], tools=environment.oai_tools,
                                    add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert script.calls[0][0] == tok.encode(first, add_special_tokens=False)
    called, guessed = episodes
    sequence = check_trajectory(tok, called)
    check_trajectory(tok, guessed)
    state = called.env.result
    conversation = [renderable(m) for m in [*state["prompt"], *state["completion"]]]
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool", "assistant"]
    assert conversation[2]["content"] == "5535"  # the tool ran on the parsed call
    assert sequence == tok.encode(tok.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)
    assert [e.stop_reason for e in episodes] == ["no_tools_called", "no_tools_called"]
    weights = verifiers_envs.CALCULATOR_WEIGHTS
    assert returns == [weights[0] * 1 + weights[1] * 1, 0.0]  # correct, called
    assert called.metrics["mul_calls"] == called.metrics["correct"] == 1.0
    assert called.metrics["tool_calls"] == 1  # parsed in env.tool_format


def test_a_multiturn_env_with_feedback():
    """A `MultiTurnEnv`: a wrong answer, the environment's feedback (mask 0), the answer; scored per turn count."""
    actions = [[["5", "0", "0", "0", "<eos>"], ["5", "5", "3", "5", "<eos>"]]]
    tok, (episode,), _, returns = play("load_feedback", actions, 1)
    sequence = check_trajectory(tok, episode)
    feedback = tok.encode("<user>error<eos><bot>", add_special_tokens=False)
    after_first = len(episode.prompt) + 5
    assert sequence[after_first : after_first + len(feedback)] == feedback
    assert episode.stop_reason == "has_final_env_response"
    assert returns == [pytest.approx(1.0 - 0.1 * 2)]


def test_episodes_cut_short_end_their_rollouts_as_a_server_would():
    """One action cut at the token budget reaches verifiers as `finish_reason: length` (scored as it stands); a
    request after lorarl's last turn gets the context-length error, which verifiers ends a rollout on."""
    actions = [[list("5535555555555")], [CALL]]
    _, (cut, last_turn), _, returns = play("load_calculator", actions, 1, "env.max_tokens=12", "env.max_turns=1")
    assert (cut.stop_reason, last_turn.stop_reason) == ("budget", "max_turns")
    assert cut.env.result["trajectory"][-1]["is_truncated"]
    assert cut.env.result["is_truncated"]
    assert cut.env.result["completion"][-1]["content"] == "5535555555555"[:12]  # what was sampled of it
    assert last_turn.env.result["stop_condition"] == "prompt_too_long"
    (call,) = last_turn.env.result["completion"]  # verifiers keeps the conversation of its last model turn
    assert call["tool_calls"][0]["function"] == {"name": "mul", "arguments": '{"a": 123, "b": 45}'}
    assert returns == [verifiers_envs.CALCULATOR_WEIGHTS[0], 0.0]  # the cut answer holds 5535


def test_an_environment_that_cannot_be_loaded_is_named():
    with pytest.raises(ConfigError, match=r"^env=verifiers needs env.verifiers.id"):
        load_config(None, ["env=verifiers"])
    tok = build_tokenizer()
    config = load_config(None, ["env=verifiers", f"env.verifiers.id={FIXTURES}:missing"])
    run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
    with pytest.raises(TrainerError, match=r"env.verifiers.id=.*:missing': cannot load the environment"):
        run.start([ROW], 1)


def test_without_the_extra_the_run_is_refused_in_one_line(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.delitem(sys.modules, "lorarl.trainer.envs.verifiers_env", raising=False)
    with pytest.raises(TrainerError, match=r"^env=verifiers needs the verifiers extra: uv sync --extra verifiers"):
        importlib.import_module("lorarl.trainer.envs.verifiers_env")


def train_on_verifiers(tmp_path, loader: str, *extra: str) -> list[dict]:
    """Two steps of the embedded calculator model on a verifiers environment, its rubric the only reward."""
    pairs = [(123, 45), (321, 54), (456, 78), (654, 87), (789, 12), (987, 21), (111, 11), (222, 22)]
    rows = [{"prompt": [{"role": "user", "content": f"{a}*{b}"}], "answer": str(a * b)} for a, b in pairs]
    return train_two_steps(tmp_path, default_task.EMBEDDED["calculator"], rows, "env=verifiers",
                           f"env.verifiers.id={FIXTURES}:{loader}", "env.tool_format=compact", "reward.fn=none",
                           "env.max_tokens=48", "rollout.max_tokens=16", *extra)  # fmt: skip


@pytest.mark.parametrize("loader", ["load_calculator", "load_feedback"])
def test_a_run_trains_on_a_verifiers_environment(tmp_path, loader):
    """Two steps on the HF engine: the engine's log-probs of the action tokens as the trainer recomputes them, the
    rubric's functions logged."""
    steps = train_on_verifiers(tmp_path, loader)
    assert len(steps) == 2
    assert all(s["rollout/abs_logp_diff"] < 0.02 for s in steps)
    assert all("env/correct" in s for s in steps)

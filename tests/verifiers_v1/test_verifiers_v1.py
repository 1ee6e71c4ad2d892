"""verifiers v1 (0.4) environments, unchanged, trained on lorarl's engine: verifiers' own harness (its chat loop, a
program of its own) plays each episode against lorarl's token-in/token-out route; its toolsets serve their tools;
an `Env` answers with feedback; and every trainable branch verifiers records is what the engine sampled, checked
against lorarl's own record of each turn."""

from pathlib import Path

import pytest
from chat_fixtures import chat_model_dir, hermes_call, train_two_steps

from lorarl.trainer.config import load_config
from lorarl.trainer.data import Example
from lorarl.trainer.engines import Completion, SamplingParams
from lorarl.trainer.envs.episodes import EnvError, EpisodeRunner
from lorarl.trainer.envs.verifiers_v1 import check_branches
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.models import load_tokenizer

HERE = Path(__file__).resolve().parent
GREET = [{"idx": i, "prompt": f"Say {w}", "answer": w} for i, w in enumerate(("hi", "yo", "hey", "ok"))]
SUMS = [{"idx": 0, "prompt": "2+3=?", "answer": "5"}, {"idx": 1, "prompt": "10+7=?", "answer": "17"}]
GUESSES = [{"idx": 0, "prompt": "Guess the word", "answer": "hi"}, {"idx": 1, "prompt": "Guess the word",
                                                                       "answer": "yo"}]  # fmt: skip
TOOLS = ("env.verifiers.id=v1_tools", "env.verifiers.renderer={tool_parser: qwen3}")
VLLM = ("rollout.engine=vllm", "rollout.dtype=float32", "rollout.vllm.kv_cache_gb=0.25")


class Replies:
    """The engine's side, written out: each context's reply (`rule` of its text), ended by end-of-sequence."""

    def __init__(self, tokenizer, rule):
        self.tokenizer, self.rule = tokenizer, rule

    def __call__(self, prompts, sampling: list[SamplingParams]) -> list[Completion]:
        completions = []
        for index, prompt in enumerate(prompts):
            ids = (*self.tokenizer.encode(self.rule(self.tokenizer.decode(prompt)), add_special_tokens=False),
                   self.tokenizer.eos_token_id)  # fmt: skip
            completions.append(Completion(index, ids, tuple(-0.5 - 0.01 * i for i in range(len(ids))), True, 0))
        return completions


def played(tmp_path, rows: list[dict], rule, *settings: str) -> list:
    """One episode of each row, on `rule`'s replies."""
    tok = load_tokenizer(chat_model_dir(tmp_path / "model"))
    config = load_config(None, ["env=verifiers", *settings])
    run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
    examples = [Example(r["prompt"], r.get("answer"), (), {"idx": r["idx"]}, f"rows line {i + 1}")
                for i, r in enumerate(rows)]  # fmt: skip
    episodes = run.episodes(examples, 1)
    run.play(Replies(tok, rule), episodes, SamplingParams(max_tokens=64))
    return episodes


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    """verifiers runs a toolset as `python -m <its module>`: these tests' modules importable there."""
    monkeypatch.setenv("PYTHONPATH", str(HERE))


def sums(context: str) -> str:
    """2+3: the tool first, then its answer; 10+7: the answer at once."""
    if "10+7" in context:
        return "17"
    return "5" if "<tool_response>" in context else hermes_call("add", {"a": 2, "b": 3})


def test_a_toolset_serves_its_tool_and_two_weighted_rewards_score_the_episode(tmp_path):
    episodes = played(tmp_path, SUMS, sums, *TOOLS)
    assert [e.stop_reason for e in episodes] == ["agent_completed"] * 2
    assert [len(e.actions) for e in episodes] == [2, 1]  # the tool called, then answered; answered at once
    assert "<tool_response>5</tool_response>" in episodes[0].env.tokenizer.decode(list(episodes[0].context))
    assert [sum(e.rewards) for e in episodes] == [1.5, 1.0]  # correct (weight 1) + used_tool (weight 0.5)
    assert [(e.metrics["correct"], e.metrics["used_tool"]) for e in episodes] == [(1.0, 1.0), (1.0, 0.0)]


def test_an_env_answers_each_wrong_guess_with_feedback(tmp_path):
    episodes = played(tmp_path, GUESSES, lambda context: "yo", "env.verifiers.id=v1_guess")  # right for the 2nd
    first, second = episodes
    assert (len(second.actions), sum(second.rewards)) == (1, 1.5)  # solved + quick (0.5 x 1/1)
    assert (len(first.actions), sum(first.rewards)) == (3, 0.0)  # three wrong guesses: unsolved
    text = first.env.tokenizer.decode(list(first.context))
    assert text.count("Wrong,tryagain.") == 2  # (the tests' tokenizer has no spaces)
    assert len(first.segments) == 1  # each feedback extends the context: one sequence, the feedback masked


def test_a_taskset_that_does_not_load_a_harness_that_crashes_or_hangs_each_in_one_line(tmp_path):
    """Each in one line naming the episode, or scored (`env.on_error=score`); a harness that hangs holds up only its
    own episode, which ends at `env.timeout_s`."""
    with pytest.raises(EnvError, match=r"^the environment \(verifiers\) raised in reset on the episode of rows line 1: "
                                       r"TrainerError: env.verifiers.id='no_such_taskset': cannot load the v1 "
                                       r"environment: "):  # fmt: skip
        played(tmp_path, GREET[:1], lambda context: "hi", "env.verifiers.id=no_such_taskset")
    crash = [{"idx": 0, "prompt": "crash"}]
    with pytest.raises(EnvError, match=r"^the environment \(verifiers\) raised in reset on the episode of rows line 1: "
                                       r"TrainerError: its program ended before asking the model: .*the harness "
                                       r"crashed") as crashed:  # fmt: skip
        played(tmp_path, crash, lambda context: "hi", "env.verifiers.id=v1_broken")
    assert "\n" not in str(crashed.value)
    [scored] = played(tmp_path, crash, lambda context: "hi", "env.verifiers.id=v1_broken", "env.on_error=score",
                      "env.error_score=-1")  # fmt: skip
    assert (scored.stop_reason, scored.rewards) == ("error", [-1.0])
    hung, answered = played(tmp_path, [{"idx": 0, "prompt": "hang"}, {"idx": 1, "prompt": "Say hi"}],
                            lambda context: "hi", "env.verifiers.id=v1_broken", "env.on_error=score",
                            "env.timeout_s=8")  # fmt: skip
    assert (hung.stop_reason, hung.rewards) == ("timeout", [0.0])
    assert (answered.stop_reason, answered.rewards) == ("agent_completed", [1.0])  # not held by the other's harness


def test_a_tool_server_that_fails_is_one_line_naming_it(tmp_path):
    """The harness's error, a traceback from the tool server's client, in one line: its first line and the exception
    it ended with."""
    with pytest.raises(EnvError, match=r"^the environment \(verifiers\) raised in reset on the episode of rows line 1: "
                                       r"TrainerError: its program ended before asking the model: HarnessError: "
                                       r"harness 'null' exited 1: .* \.\.\. mcp\.shared\.exceptions\.MCPError: Server "
                                       r"returned an error response \(env.on_error=score") as failed:  # fmt: skip
        played(tmp_path, SUMS[:1], sums, "env.verifiers.id=v1_deadtools")
    assert "\n" not in str(failed.value)
    assert "Traceback" not in str(failed.value)


def test_a_branch_that_is_not_what_the_engine_sampled_is_refused_naming_the_episode(tmp_path):
    episodes = played(tmp_path, GREET[:1], lambda context: "hi", "env.verifiers.id=v1_tasks")
    episode = episodes[0]
    trace = episode.env._trace()
    check_branches(episode, trace)  # as played: the same
    episode.segments[0].logprobs[-1] += 0.5
    with pytest.raises(TrainerError, match=r"^the v1 episode of rows line 1: verifiers' branch 0 is not the tokens "
                                           r"lorarl's engine sampled"):  # fmt: skip
        check_branches(episode, trace)


@pytest.mark.parametrize(("rows", "settings", "engine"), [(GREET, ("env.verifiers.id=v1_tasks",), "hf"),
                                                          (SUMS, TOOLS, "hf"), (SUMS, TOOLS, "vllm"),
                                                          (GUESSES, ("env.verifiers.id=v1_guess",), "hf")],
                         ids=["greet-hf", "tools-hf", "tools-vllm", "guess-hf"])  # fmt: skip
def test_a_v1_environment_trains_two_steps(tmp_path, engine, rows, settings):
    """Two steps on the HF engine, and the tool-calling environment (the most the route carries: turns, tool
    responses, stop strings) on vLLM's CPU build too; each step's engine log-probs as the trainer recomputes them
    on the action tokens."""
    engine_keys = VLLM if engine == "vllm" else ()
    model = chat_model_dir(tmp_path / "model", head_dim=32 if engine == "vllm" else 8)
    steps = train_two_steps(tmp_path, model, rows, "env=verifiers", *settings, "rollout.max_tokens=8",
                            "env.max_tokens=32", "data.batch_size=2", *engine_keys)  # fmt: skip
    assert len(steps) == 2
    assert all(s["rollout/abs_logp_diff"] < 0.02 for s in steps)


def test_a_taskset_package_with_its_own_stop_condition_runs_unchanged(tmp_path):
    """`letter_count/`, a taskset package in verifiers' documented shape (its id `letter-count`): its stop condition
    ends each episode and names the stop, its reward scores it, and two steps train on it."""
    from letter_count.taskset import SYSTEM, WORDS

    rows = [{"idx": i, "prompt": word, "system_prompt": SYSTEM, "answer": str(len(word))}
            for i, word in enumerate(WORDS[:4])]  # fmt: skip
    episodes = played(tmp_path, rows, lambda context: "4", "env.verifiers.id=letter-count")
    assert [e.stop_reason for e in episodes] == ["answered"] * 4
    assert [sum(e.rewards) for e in episodes] == [0.5, 1.0, 0.5, 1 / 3]  # cat, tree, apple, go: 4 is 1, 0, 1, 2 off
    steps = train_two_steps(tmp_path, chat_model_dir(tmp_path / "model"), rows, "env=verifiers",
                            "env.verifiers.id=letter-count", "rollout.max_tokens=8", "env.max_tokens=32",
                            "data.batch_size=2")  # fmt: skip
    assert len(steps) == 2
    assert all(s["rollout/abs_logp_diff"] < 0.02 for s in steps)
    assert all(0.0 <= s["env/closeness"] <= 1.0 for s in steps)  # its reward, logged

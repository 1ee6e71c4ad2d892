"""Answer extraction and built-in rewards; user functions by module or by file, in lorarl's, TRL's and verl's
signatures, weighted; failures reported with their sample or scored; slow rewards in a pool with a timeout."""

import re
import time

import pytest

from lorarl.trainer import default_task
from lorarl.trainer.config import load_config
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.math_reward import equivalent, extract_answer, math_exact
from lorarl.trainer.rewards import Response, RewardError, call, load_reward, style
from lorarl.trainer.scoring import Rewards


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("so the total is $1,234.\n#### 1,234", "1,234"),
        ("The answer is \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("no final answer here", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("predicted", "reference", "same"),
    [("72", "72", True), ("1,234", "1234", True), ("3.0", "3", True), ("$5", "5", True), ("\\text{5}", "5", True),
     ("0.5", "1/2", False), ("7", "8", False), ("x+1", "x + 1", True)],
)  # fmt: skip
def test_equivalent(predicted, reference, same):
    assert equivalent(predicted, reference) is same


def test_math_exact_reward():
    assert math_exact("q", "... so \\boxed{72}", "#### 72") == 1.0
    assert math_exact("q", "#### 72", "72") == 1.0
    assert math_exact("q", "I think 72", "#### 72") == 0.0  # no marked final answer
    assert math_exact("q", "\\boxed{71}", "#### 72") == 0.0


def test_default_task_reward():
    assert default_task.reward("12+30=", "42", "42") == 1.0
    assert default_task.reward("12+30=", "41", "42") == 0.0


def test_user_functions_by_module_and_by_file(tmp_path):
    assert load_reward("lorarl.trainer.math_reward:math_exact").target is math_exact
    path = tmp_path / "my_reward.py"
    path.write_text("def length(prompt, response, answer):\n    return len(response)\n")
    assert load_reward(f"{path}:length")("p", "abc", "a") == 3
    with pytest.raises(TrainerError, match="has no 'missing'"):
        load_reward(f"{path}:missing")
    with pytest.raises(TrainerError, match="unknown reward 'nonsense': expected one of default, math"):
        load_reward("nonsense")


def test_a_function_its_format_cannot_call_is_refused_when_it_loads(tmp_path):
    path = tmp_path / "shapes.py"
    path.write_text(
        "def one(x):\n    return 1.0\n"
        "def verl(data_source, solution_str, ground_truth, extra_info=None, *, weight):\n    return 1.0\n"
        "def extra(prompt, response, answer, tokens=0, **kw):\n    return 1.0\n"
        "def trl(prompts, completions, lengths):\n    return [1.0]\n"
    )
    with pytest.raises(TrainerError, match=re.escape(f"reward.fn='{path}:one': one(x) cannot be called as f(prompt, "
                                                     "response, answer) (too many positional arguments)")):  # fmt: skip
        load_reward(f"{path}:one")
    with pytest.raises(TrainerError, match=re.escape("cannot be called as compute_score(data_source, solution_str, "
                                                     "ground_truth, extra_info) (missing a required argument: "
                                                     "'weight')")):  # fmt: skip
        load_reward(f"{path}:verl")
    assert load_reward(f"{path}:extra")("p", "r", "a") == 1.0  # optional and keyword parameters are fine
    assert load_reward(f"{path}:trl").name == "trl"  # TRL's format passes the dataset columns a function names


def responses(*texts: str, prompt="p", columns=None) -> list[Response]:
    return [Response(prompt, text, "a", dict(columns or {}), (i,)) for i, text in enumerate(texts)]


def test_a_failure_is_reported_with_its_sample():
    def broken(prompt, response, answer):
        return 1 / 0 if response == "bad" else 1.0

    with pytest.raises(RewardError, match=r"raised ZeroDivisionError.*response='bad'"):
        call(broken, responses("ok", "bad"))
    with pytest.raises(TrainerError, match="returned 'yes', not a number"):
        call(lambda p, r, a: "yes", responses("r"))
    assert call(lambda p, r, a: True, responses("r")) == [1.0]


def test_trl_reward_functions_run_as_written():
    """TRL's signature: prompts and completions batched, dataset columns as keyword lists, None = no score; chat
    prompts get their completions as assistant messages (as TRL passes them)."""
    seen = {}

    def accuracy_reward(prompts, completions, solution, **kwargs):
        seen.update(prompts=prompts, completions=completions, solution=solution, **kwargs)
        return [None if c == "skip" else float(c == s) for c, s in zip(completions, solution, strict=True)]

    assert style(accuracy_reward) == "trl"
    batch = [Response("1+1", c, "2", {"solution": s, "level": 3}, (7, 8)) for c, s in [("2", "2"), ("3", "2"),
                                                                                    ("skip", "2")]]  # fmt: skip
    assert call(accuracy_reward, batch) == [1.0, 0.0, None]
    logging = {key: seen.pop(key) for key in ("trainer_state", "log_metric", "log_extra")}  # TRL passes them too
    assert seen == {"prompts": ["1+1"] * 3, "completions": ["2", "3", "skip"], "solution": ["2"] * 3,
                    "level": [3] * 3, "completion_ids": [[7, 8]] * 3}  # fmt: skip
    assert logging["trainer_state"] is None  # outside a run
    assert callable(logging["log_metric"])
    assert callable(logging["log_extra"])

    def format_reward(prompts, completions):  # no **kwargs: gets only what it names
        return [float(c[0]["content"].startswith("<think>")) for c in completions]

    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert call(format_reward, [Response(chat, "<think>x", "a", {}), Response(chat, "no", "a", {})]) == [1.0, 0.0]
    with pytest.raises(RewardError, match="returned 1 scores for 2 completions"):
        call(lambda prompts, completions: [1.0], responses("a", "b"))


def test_verl_compute_score_runs_as_written():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        bonus = extra_info["bonus"] if extra_info else 0.0
        return {"score": float(solution_str == ground_truth) + bonus, "acc": data_source}

    assert style(compute_score) == "verl"
    batch = [Response("p", "a", "a", {"data_source": "gsm8k", "extra_info": {"bonus": 0.5}}),
             Response("p", "b", "a", {"data_source": "gsm8k"})]  # fmt: skip
    assert call(compute_score, batch) == [1.5, 0.0]


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "import os, signal, time\n"
        "def exact(prompt, response, answer):\n    return float(response == answer)\n"
        "def length(prompts, completions, **kwargs):\n"
        "    return [None if c == 'none' else len(c) / 10 for c in completions]\n"
        "def flaky(prompt, response, answer):\n"
        "    if response == 'boom':\n        raise RuntimeError('boom')\n"
        "    if response == 'crash':  # the worker process dies\n        os._exit(3)\n"
        "    if response == 'slow':\n        time.sleep(60)\n"
        "    if response == 'stuck':  # where no timer reaches: the pool has to kill it\n"
        "        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n        time.sleep(60)\n"
        "    return 1.0\n"
    )
    return path


def rewards_from(overrides: list[str]) -> Rewards:
    return Rewards(load_config(None, overrides).reward)


def test_several_functions_are_weighted_and_logged_each(reward_file):
    reward = rewards_from([f"reward.fns=[{reward_file}:exact,{reward_file}:length]", "reward.weights=[2.0,0.5]"])
    batch = [Response("p", text, "abcd", {}) for text in ("abcd", "ab", "none")]
    scores = reward.score(batch)
    expected = [2.0 * float(t == "abcd") + (0.0 if t == "none" else 0.5 * len(t) / 10) for t in ("abcd", "ab", "none")]
    assert [s.total for s in scores] == pytest.approx(expected)
    assert [s.parts for s in scores] == [(1.0, 0.4), (0.0, 0.2), (0.0, None)]
    assert reward.metrics(scores) == pytest.approx({"reward/fn/exact": 1 / 3, "reward/fn/length": 0.3})


def test_a_failure_is_scored_as_configured(reward_file):
    batch = [Response("p", text, "a", {}) for text in ("fine", "boom", "fine")]
    with pytest.raises(RewardError, match=r"raised RuntimeError: boom on: prompt='p', response='boom'"):
        rewards_from([f"reward.fn={reward_file}:flaky"]).score(batch)
    reward = rewards_from([f"reward.fn={reward_file}:flaky", "reward.on_error=score", "reward.error_score=-1"])
    scores = reward.score(batch)
    assert [s.total for s in scores] == [1.0, -1.0, 1.0]
    assert reward.metrics(scores) == {"reward/errors": 1}


def test_a_pool_scores_slow_rewards_and_stops_those_past_the_timeout(reward_file):
    reward = rewards_from([f"reward.fn={reward_file}:flaky", "reward.workers=2", "reward.timeout_s=1",
                           "reward.on_error=score", "reward.error_score=-1"])  # fmt: skip
    try:
        started = time.perf_counter()
        scores = reward.score([Response("p", t, "a", {}) for t in ("fine", "slow", "boom", "stuck", "fine")])
        elapsed = time.perf_counter() - started
        assert [s.total for s in scores] == [1.0, -1.0, -1.0, -1.0, 1.0]
        assert elapsed < 20  # the sleeps were 60 s: the timer stopped one, the pool's deadline the other
        assert [s.total for s in reward.score([Response("p", "fine", "a", {})])] == [1.0]  # a fresh pool after a kill
        scores = reward.score([Response("p", t, "a", {}) for t in ("crash", "fine")])  # the crash breaks the pool
        assert scores[0].total == -1.0
        assert scores[0].errors == 1
        assert [s.total for s in reward.score([Response("p", "fine", "a", {})])] == [1.0]  # and a fresh one scores
    finally:
        reward.close()
    strict = rewards_from([f"reward.fn={reward_file}:flaky", "reward.workers=1", "reward.timeout_s=1"])
    try:
        with pytest.raises(RewardError, match=r"did not return: a reward worker process died .*response='crash'"):
            strict.score([Response("p", "crash", "a", {})])
        assert [s.total for s in strict.score([Response("p", "fine", "a", {})])] == [1.0]  # a fresh pool
    finally:
        strict.close()
    try:
        with pytest.raises(RewardError, match=r"raised TimeoutError: timed out after 1.0 s on: .*response='slow'"):
            strict.score([Response("p", "slow", "a", {})])
    finally:
        strict.close()

"""Answer extraction and built-in rewards; user functions by module or by file."""

import pytest

from lorarl.trainer import default_task
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.rewards import equivalent, extract_answer, load_reward, math_exact, score


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
    assert load_reward("lorarl.trainer.rewards:math_exact") is math_exact
    path = tmp_path / "my_reward.py"
    path.write_text("def length(prompt, response, answer):\n    return len(response)\n")
    assert load_reward(f"{path}:length")("p", "abc", "a") == 3
    with pytest.raises(TrainerError, match="no function 'missing'"):
        load_reward(f"{path}:missing")
    with pytest.raises(TrainerError, match="not a built-in"):
        load_reward("nonsense")


def test_score_reports_the_failing_sample():
    def broken(prompt, response, answer):
        return 1 / 0 if response == "bad" else 1.0

    with pytest.raises(TrainerError, match=r"ZeroDivisionError.*sample 1.*response='bad'"):
        score(broken, ["p0", "p1"], ["ok", "bad"], ["a", "a"])
    with pytest.raises(TrainerError, match="not a number"):
        score(lambda p, r, a: "yes", ["p"], ["r"], ["a"])
    assert score(lambda p, r, a: True, ["p"], ["r"], ["a"]) == [1.0]

"""The SmolLM2 recipe's parts that run without the network: its task files (train and validation disjoint) load as
the trainer reads them, its rewards (the last number; the number that ends the response), its config is valid."""

import importlib.util
from pathlib import Path

from lorarl.trainer.config import load_config
from lorarl.trainer.data import read_rows
from lorarl.trainer.presets import PRESETS
from lorarl.trainer.rewards import load_reward

RECIPE = Path(__file__).parents[1] / "recipes" / "smollm2"


def fetch_module():
    """The recipe's `fetch.py`, imported (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("fetch", RECIPE / "fetch.py")
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    return fetch


def rows_of(directory: Path, name: str) -> list[dict]:
    return [r.fields for r in read_rows([str(directory / name)], default_file="")]


def test_the_task_is_disjoint_and_the_reward_takes_the_last_number(tmp_path):
    fetch = fetch_module()
    fetch.write_task(tmp_path)
    train, val = rows_of(tmp_path, "train.jsonl"), rows_of(tmp_path, "val.jsonl")
    assert (len(train), len(val)) == (90 * 90 - 200, 200)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    a, b = (int(x) for x in val[0]["prompt"].removeprefix("What is ").split("?")[0].split(" + "))
    assert val[0]["answer"] == str(a + b)
    reward = load_reward(f"{RECIPE / 'reward.py'}:last_number")
    assert reward("", "23 + 45 = 68", "68") == 1.0
    assert reward("", "23 + 45 = 78", "68") == 0.0
    assert reward("", "The sum is 1,068.", "1068") == 1.0
    assert reward("", "no idea", "68") == 0.0
    config = load_config(RECIPE / "addition.yaml", presets=PRESETS)
    assert config.model.gguf_file == fetch.GGUF
    assert config.reward.fn.endswith("reward.py:number_at_end")  # the recipe trains with the stricter reward


def test_the_answer_must_end_the_response():
    """`number_at_end`: what the benchmark's runs showed the policy drifting into after the answer — the turn cut off
    at max_tokens, tokens in place of the end of the turn — scores 0 (the answers here, from the runs' checkpoints)."""
    reward = load_reward(f"{RECIPE / 'reward.py'}:number_at_end")
    for right, answer in (("68", "68"), ("23 + 45 = 68", "68"), ("23 + 45 = 68.", "68"), ("The sum is 1,068. ", "1068"),
                          ("68\n", "68")):  # fmt: skip
        assert reward("", right, answer) == 1.0, right
    for wrong in ("23 + 45 = 68.\n\nThe answer is", "23 + 45 = 68 Worksheeton", "58 + 44 = 63%||58%||44", "168", "-68",
                  "23 + 45 = 78", "no idea"):  # fmt: skip
        assert reward("", wrong, "68") == 0.0, wrong


def test_the_calculator_recipe_asks_with_its_tool_and_loads(tmp_path):
    """The multi-turn recipe: products asked with a system prompt describing the tool, train and validation disjoint,
    the tool's schema from its signature, the config valid."""
    from lorarl.trainer.envs.tools import load_tools

    fetch = fetch_module()
    fetch.write_tool_task(tmp_path)
    train, val = rows_of(tmp_path, "multiply_train.jsonl"), rows_of(tmp_path, "multiply_val.jsonl")
    assert (len(train), len(val)) == (20_000, 200)
    questions = {r["prompt"][-1]["content"] for r in train}
    assert not questions & {r["prompt"][-1]["content"] for r in val}
    a, b = (int(x) for x in val[0]["prompt"][-1]["content"].removeprefix("What is ").rstrip("?").split(" * "))
    assert val[0]["answer"] == str(a * b)
    assert "<call>multiply A B</call>" in val[0]["prompt"][0]["content"]
    config = load_config(RECIPE / "calculator.yaml", presets=PRESETS)
    assert (config.env.name, config.env.tool_format) == ("tools", "compact")
    (tool,) = load_tools(config.env.tools)
    assert tool.name == "multiply"
    assert tool({"a": 123, "b": 45}) == "5535"

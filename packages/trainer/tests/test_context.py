"""A prompt and its budget fit the model's positions: checked before anything loads, `data.max_prompt_tokens` left
unset taking the room the budget leaves (a vLLM engine capped lower: tests/vllm_cpu/test_multiturn_vllm.py)."""

import re

import pytest

from lorarl.trainer import default_task
from lorarl.trainer.cli import main
from lorarl.trainer.config import load_config
from lorarl.trainer.context import fit_context, model_positions
from lorarl.trainer.errors import ConfigError

CALCULATOR = default_task.EMBEDDED["calculator"]  # 64 positions
DEFAULT = default_task.EMBEDDED["default"]  # 32


def test_an_unset_max_prompt_tokens_takes_the_room_the_budget_leaves():
    assert (model_positions(CALCULATOR), model_positions(DEFAULT)) == (64, 32)
    calculator = load_config(None, ["task=calculator"])
    assert fit_context(calculator, CALCULATOR) == 64
    assert calculator.data.max_prompt_tokens == 64 - calculator.env.max_tokens
    single = load_config(None, [])
    assert fit_context(single, DEFAULT) == 32
    assert single.data.max_prompt_tokens == 32 - single.rollout.max_tokens
    roomy = load_config(None, ["rollout.max_tokens=8"])
    assert (fit_context(roomy, CALCULATOR), roomy.data.max_prompt_tokens) == (64, 56)


@pytest.mark.parametrize(("overrides", "budget", "prompt"), [
    ([], 16, 16),  # neither set: half the positions each
    (["data.max_prompt_tokens=10"], 22, 10),  # the room the prompt leaves
])  # fmt: skip
def test_an_unset_env_max_tokens_takes_the_room_the_prompt_leaves(overrides, budget, prompt):
    """An environment on the embedded default model (32 positions): its episode budget fits beside the prompt, where
    a fixed 512 refused every run."""
    config = load_config(None, ["env=tools", *overrides])
    assert fit_context(config, DEFAULT) == 32
    assert (config.env.max_tokens, config.data.max_prompt_tokens) == (budget, prompt)


@pytest.mark.parametrize(("overrides", "message"), [
    (["task=calculator", "data.max_prompt_tokens=30"], "data.max_prompt_tokens=30 + env.max_tokens=40 is more than "
     "the model's 64 positions (max_position_embeddings): lower one of them"),
    (["task=calculator", "env.max_tokens=64"], "env.max_tokens=64 leaves no room for a prompt (data.max_prompt_tokens) "
     "in the model's 64 positions (max_position_embeddings): lower it"),
    (["data.max_prompt_tokens=30"], "data.max_prompt_tokens=30 + rollout.max_tokens=8 is more than the model's 32 "
     "positions"),
])  # fmt: skip
def test_a_budget_beyond_the_models_positions_is_refused_in_one_line_naming_the_keys(tmp_path, capsys, overrides,
                                                                                   message):  # fmt: skip
    config = load_config(None, overrides)
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        fit_context(config, CALCULATOR if "task=calculator" in overrides else DEFAULT)
    out = tmp_path / "out"
    assert main([*overrides, f"trainer.output_dir={out}"]) == 2
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith(f"error: {message}")
    assert not out.exists()

"""Bad inputs end with a clear message and a non-zero exit code, before any training starts."""

import pytest
from trainer_fixtures import tiny_overrides

from lorarl.trainer.cli import main


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"data__train_files": "[/nonexistent/train.jsonl]"}, "data file /nonexistent/train.jsonl not found"),
        ({"data__max_prompt_tokens": 2}, "no usable prompts"),
        ({"reward__fn": "no_such_module:fn"}, "cannot import no_such_module"),
        ({"reward__fn": "/nonexistent/reward.py:fn"}, "not found"),
        ({"model__lora__rank": -1}, "model.lora.rank must be >= 0"),
        ({"model__path": "/nonexistent/model"}, "is not a Hugging Face model directory"),
        ({"model__lora__rnak": 4}, "did you mean 'model.lora.rank'"),
        ({"trainer__steps": "many"}, "trainer.steps"),
        ({"rollout__sync": "auto", "model__lora__rank": 0}, "rollout.sync=auto needs a LoRA adapter"),
        (
            {"rollout__engine": "vllm", "rollout__devices": "1", "rollout__sync": "adapter", "model__lora__rank": 0},
            "rollout.sync=adapter needs a LoRA adapter",
        ),
    ],
)
def test_bad_input_exits_with_a_clear_message(tiny_setup, tmp_path, capsys, extra, message):
    assert main(tiny_overrides(tiny_setup, tmp_path / "out", **extra)) == 2
    assert message in capsys.readouterr().out


def test_empty_dataset(tiny_setup, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(tiny_overrides(tiny_setup, tmp_path / "out", data__train_files=f"[{empty}]")) == 2
    assert "no usable prompts" in capsys.readouterr().out


def test_a_failing_reward_is_reported_with_its_sample(tiny_setup, tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("def reward(prompt, response, answer):\n    raise KeyError('oops')\n")
    assert main(tiny_overrides(tiny_setup, tmp_path / "out", reward__fn=f"{broken}:reward", trainer__steps=1)) == 2
    out = capsys.readouterr().out
    assert "KeyError" in out
    assert "prompt=" in out


def test_help_lists_every_key(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for key in ("model.lora.rank", "rollout.n", "algorithm.clip_high", "trainer.resume", "reward.fn"):
        assert key in out
    for preset in ("grpo", "dapo", "drgrpo", "rloo", "gspo"):  # the presets, with what each sets
        assert f"\n  {preset} " in out
    assert "clip_high=0.28 dynamic_sampling=True overlong_buffer_frac=0.2" in out

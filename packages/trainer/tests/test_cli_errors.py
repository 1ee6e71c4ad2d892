"""Bad inputs end with a clear message and a non-zero exit code, before any training starts."""

import re
import shutil

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
        ({"model__lora__rank": -1}, "model.lora.rank=-1: expected a value >= 0"),
        ({"model__path": "/nonexistent/model"}, "is not a Hugging Face model directory"),
        ({"model__lora__rnak": 4}, "did you mean 'model.lora.rank'"),
        ({"trainer__steps": "many"}, "trainer.steps"),
        ({"rollout__sync": "auto", "model__lora__rank": 0}, "rollout.sync=auto needs a LoRA adapter"),
        ({"data__batch_size": 400}, "data.batch_size=400 is larger than the 300 training prompts"),
        (
            {"model__lora__target_modules": "[q_proj,v_prj]"},  # peft would adapt q_proj alone, silently
            "model.lora.target_modules=['q_proj', 'v_prj']: the model has no module v_prj; its linear layers are "
            "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj (or all-linear)",
        ),
        (
            {"algorithm__adv_estimator": "gae", "critic__lora__target_modules": "[qq]"},  # on the policy's peft model
            "critic.lora.target_modules=['qq']: the model has no module qq; its linear layers are down_proj, gate_proj",
        ),
        (
            {
                "rollout__engine": "vllm",
                "rollout__vllm__devices": "1",
                "rollout__sync": "adapter",
                "model__lora__rank": 0,
            },
            "rollout.sync=adapter needs a LoRA adapter",
        ),
    ],
)
def test_bad_input_exits_with_a_clear_message(tiny_setup, tmp_path, capsys, extra, message):
    assert main(tiny_overrides(tiny_setup, tmp_path / "out", **extra)) == 2
    assert message in capsys.readouterr().out


def test_bad_data_or_tools_are_named_before_the_model_loads_and_leave_no_output_folder(tiny_setup, tmp_path, capsys):
    """A model whose weights are damaged: it is never read, because the data (and the tools) are checked first."""
    model = tmp_path / "model"
    shutil.copytree(tiny_setup["model"], model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"damaged")
    untyped = tmp_path / "tools.py"
    untyped.write_text("def search(query):\n    return query\n")
    cases = [({"data__train_files": "[/nonexistent/train.jsonl]"}, "data file /nonexistent/train.jsonl not found"),
             ({"env__name": "tools", "env__tools": f"[{untyped}:search]"}, "is not a usable tool")]  # fmt: skip
    for extra, message in cases:
        out = tmp_path / "out"
        assert main(tiny_overrides(tiny_setup, out, model__path=model, **extra)) == 2
        assert message in capsys.readouterr().out
        assert not out.exists()  # the run never started: no empty output folder left behind


def test_an_output_dir_that_is_a_file_or_cannot_be_made_is_named(tiny_setup, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("")
    assert main(tiny_overrides(tiny_setup, taken)) == 2
    assert f"trainer.output_dir={taken}: {taken} exists and is not a directory" in capsys.readouterr().out
    assert main(tiny_overrides(tiny_setup, taken / "run")) == 2
    assert f"trainer.output_dir={taken / 'run'}: cannot create {taken / 'run'} (Not a directory)" in (
        capsys.readouterr().out
    )


def test_a_key_without_a_value_says_an_override_needs_one(tiny_setup, tmp_path, capsys):
    assert main([*tiny_overrides(tiny_setup, tmp_path / "out"), "actor.lr"]) == 2
    assert "'actor.lr': neither a config file nor key=value; an override needs a value (e.g. actor.lr=...)" in (
        capsys.readouterr().out
    )


def test_a_damaged_checkpoint_is_named_on_resume(tiny_setup, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(tiny_overrides(tiny_setup, out, trainer__steps=1)) == 0
    state = out / "checkpoints" / "step_1" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # cut short, as a full disk leaves it
    capsys.readouterr()
    assert main(tiny_overrides(tiny_setup, out, trainer__steps=2, trainer__resume="auto")) == 2
    message = capsys.readouterr().out
    assert f"cannot read {state} (" in message
    assert "the checkpoint is damaged; resume from another one" in message


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


def test_export_names_a_checkpoint_that_is_missing_or_holds_no_adapter(tmp_path, capsys):
    missing, empty = tmp_path / "step_9", tmp_path / "step_1"
    empty.mkdir()
    assert main(["export", "--checkpoint", str(missing), "--merged", str(tmp_path / "out")]) == 2
    assert f"--checkpoint {missing}: no such directory" in capsys.readouterr().out
    assert main(["export", "--checkpoint", str(empty), "--merged", str(tmp_path / "out")]) == 2
    assert f"{empty} holds no adapter" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_a_resume_under_settings_that_do_not_fit_the_checkpoint_names_them(tiny_setup, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    assert main(tiny_overrides(tiny_setup, out, trainer__steps=1)) == 0
    step_1 = out / "checkpoints" / "step_1"
    resume = {"trainer__resume": "auto", "trainer__steps": 2}
    cases = [
        (
            {"model__lora__rank": 4},
            f"trainer.resume: {step_1} was trained with model.lora.rank=8 (now 4): its weights are not this model's",
        ),
        (
            {"model__lora__target_modules": "[q_proj]", "model__lora__alpha": 8},
            "model.lora.alpha=32.0 (now 8.0), model.lora.target_modules=['all-linear'] (now ['q_proj'])",
        ),
        (
            {"algorithm__adv_estimator": "gae"},
            f"{step_1} holds no critic, and algorithm.adv_estimator=gae trains one; "
            "resume under the estimator it was trained with (grpo)",
        ),
    ]
    for extra, message in cases:
        assert main(tiny_overrides(tiny_setup, out, **resume, **extra)) == 2
        assert message in capsys.readouterr().out
    wider = AutoModelForCausalLM.from_pretrained(tiny_setup["model"])  # the same layers, 48 wide instead of 32
    wider.config.update({"hidden_size": 48})
    shutil.copytree(tiny_setup["model"], tmp_path / "wider")  # its tokenizer
    type(wider)(wider.config).save_pretrained(tmp_path / "wider")
    assert main(tiny_overrides(tiny_setup, out, **resume, model__path=str(tmp_path / "wider"))) == 2
    assert f"{step_1 / 'adapter'} does not fit this model (size mismatch for" in capsys.readouterr().out
    assert main(tiny_overrides(tiny_setup, out, **resume, actor__lr=0.01)) == 0  # the rest may change
    capsys.readouterr()
    assert main(tiny_overrides(tiny_setup, out, **resume)) == 0
    assert "nothing to train: the checkpoint is at step 2 and trainer.steps=2" in capsys.readouterr().out


def test_a_reward_that_raises_in_the_first_validation_says_so(tiny_setup, tmp_path, capsys):
    reward = tmp_path / "broken_reward.py"
    reward.write_text("def score(prompt, response, answer):\n    raise ValueError('no score for ' + answer)\n")
    overrides = tiny_overrides(tiny_setup, tmp_path / "out", reward__fn=f"{reward}:score", trainer__eval_every=5)
    assert main(overrides) == 2
    out = capsys.readouterr().out
    assert "the reward function raised ValueError: no score for" in out
    assert "in the validation before training (step 0) on: prompt=" in out


PLUGIN_KEYS = ["env.name", "env.tools", "reward.fn", "algorithm.policy_loss", "algorithm.adv_estimator",
               "algorithm.kl_estimator", "rollout.engine", "rollout.sync"]  # fmt: skip
BROKEN = {"SyntaxError": ("def f(:\n    pass\n", r"SyntaxError: invalid syntax \(broken\.py, line 1\)"),
          "NameError": ("x = undefined_name\n", r"NameError: name 'undefined_name' is not defined \(.*broken\.py, "
                        r"line 1\)")}  # fmt: skip


@pytest.mark.parametrize("error", BROKEN)
@pytest.mark.parametrize("key", PLUGIN_KEYS)
def test_a_plugin_file_that_fails_at_import_is_one_line_naming_the_key(tiny_setup, tmp_path, capsys, key, error):
    source, message = BROKEN[error]
    broken = tmp_path / "broken.py"
    broken.write_text(source)
    spec = f"{broken}:f"
    extra = {"env__name": "tools", "env__tools": f"[{spec}]"} if key == "env.tools" else {key.replace(".", "__"): spec}
    assert main(tiny_overrides(tiny_setup, tmp_path / "out", **extra)) == 2
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1, printed
    assert re.match(rf"^error: {re.escape(key)}(='|: cannot load ').*{re.escape(str(broken))}.*: {message}", printed[0])

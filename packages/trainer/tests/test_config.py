"""Configuration: defaults, a YAML file, dotted overrides, presets, and errors that name the key."""

import re

import pytest

from lorarl.trainer.config import ConfigError, help_text, load_config, to_yaml
from lorarl.trainer.presets import PRESETS


def test_file_then_overrides_later_wins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  lora:\n    rank: 32\n    alpha: 64\nrollout:\n  n: 4\n")
    config = load_config(path, ["rollout.n=16", "model.lora.target_modules=[q_proj,v_proj]"])
    assert config.model.lora.rank == 32
    assert config.model.lora.alpha == 64.0
    assert config.rollout.n == 16
    assert config.model.lora.target_modules == ["q_proj", "v_proj"]
    assert config.trainer.steps == 120  # untouched default


def test_resolved_config_round_trips(tmp_path):
    config = load_config(None, ["actor.lr=3e-4", "trainer.output_dir=/x"])
    (tmp_path / "c.yaml").write_text(to_yaml(config))
    assert load_config(tmp_path / "c.yaml") == config


def test_presets_then_overrides():
    config = load_config(None, ["algorithm=grpo", "algorithm.clip_high=0.3"], presets=PRESETS)
    assert config.algorithm.name == "grpo"
    assert config.algorithm.clip_high == 0.3
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config(None, ["algorithm=nope"], presets=PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_valid_algorithm_section(name):
    config = load_config(None, [f"algorithm={name}"], presets=PRESETS)
    assert config.algorithm.name == name
    for key, value in PRESETS[name].settings.items():
        if isinstance(value, dict):  # a piece's own settings
            for setting, chosen in value.items():
                assert getattr(getattr(config.algorithm, key), setting) == chosen
        else:
            assert getattr(config.algorithm, key) == value


def test_a_preset_in_the_file_then_the_file_then_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm: dapo\n")
    config = load_config(path, ["algorithm.clip_high=0.3"], presets=PRESETS)
    assert (config.algorithm.name, config.algorithm.dynamic_sampling, config.algorithm.clip_high) == ("dapo", True, 0.3)
    config = load_config(path, ["algorithm=gspo"], presets=PRESETS)  # the command line's preset wins
    assert (config.algorithm.name, config.algorithm.policy_loss) == ("gspo", "gspo")
    assert not config.algorithm.dynamic_sampling


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.lora.rnak=4"], "unknown key 'model.lora.rnak'; did you mean 'model.lora.rank'"),
        (["lr=1e-3"], "did you mean 'actor.lr'"),
        (["rollout.n=lots"], "rollout.n"),
        (["rollout.sync=sometimes"], "unknown sync kind 'sometimes': expected one of merged, adapter"),
        (["model.lora.rank"], "key=value"),
        (["rollout.n=0"], "rollout.n=0: expected a value >= 1"),
        (["algorithm.overlong_buffer_frac=1.5"], "algorithm.overlong_buffer_frac=1.5: expected a value in [0.0, 1.0]"),
        (["algorithm.rollout_correction=seq"], "expected one of none, token, sequence"),
        # rules across keys
        (["actor.lr=0"], "actor.lr=0.0: expected a value > 0"),
        (
            ["algorithm.adv_estimator=gae", "critic.lr=0"],
            "critic.lr=0.0: expected a value > 0 (adv_estimator=gae trains a critic)",
        ),
        (["rollout.n=1"], "rollout.n=1: algorithm.adv_estimator=grpo compares the responses to a prompt"),
        (["rollout.n=1", "algorithm.adv_estimator=rloo"], "algorithm.adv_estimator=rloo compares"),
        (["algorithm.dual_clip=0.5"], "algorithm.dual_clip=0.5: expected a bound > 1"),
        (["algorithm.overlong_buffer_frac=1.0"], "a buffer of 8 tokens: the overlong penalty would hit every"),
        (
            ["rollout.max_tokens=1", "algorithm.overlong_buffer_frac=0.2"],
            "overlong_buffer_frac=0.2 of rollout.max_tokens=1",
        ),
        (["rollout.min_tokens=9"], "rollout.min_tokens=9: expected at most rollout.max_tokens=8"),
        (["rollout.min_tokens=-1"], "rollout.min_tokens=-1: expected a value >= 0"),
        (["rollout.top_p=0"], "rollout.top_p=0.0: expected 0 < top_p <= 1"),
        (["rollout.top_p=1.5"], "rollout.top_p=1.5: expected a value <= 1.0"),
        (["rollout.temperature=-1"], "rollout.temperature=-1.0: expected a value >= 0.0"),
        (["rollout.temperature=0"], "rollout.temperature=0 samples greedily, one response per prompt, but rollout.n=8"),
        (["algorithm.mini_batches=1000"], "algorithm.mini_batches=1000: more than the 256 responses"),
        (["reward.fn=math", "reward.fns=[math]"], "set one (reward.fns replaces reward.fn)"),
        (["reward.fns=[math,default]", "reward.weights=[1.0]"], "expected one weight per reward function (2)"),
        (["reward.timeout_s=5"], "reward.timeout_s=5.0 needs reward.workers >= 1"),
    ],
)
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_an_episode_run_checks_the_overlong_buffer_against_env_max_tokens_only():
    """An episode's overlong buffer is a share of `env.max_tokens`: a short `rollout.max_tokens` (each action's cap)
    is no reason to refuse it."""
    overrides = ["task=calculator", "algorithm.overlong_buffer_frac=0.2", "rollout.max_tokens=1"]
    config = load_config(None, overrides)
    assert config.rollout.max_tokens == 1
    assert config.algorithm.overlong_buffer_frac > 0
    with pytest.raises(ConfigError, match=r"a share of env\.max_tokens=4, and covers all of it"):
        load_config(None, [*overrides, "env.max_tokens=4", "algorithm.overlong_buffer_frac=1.0"])


def test_an_engine_whose_module_is_missing_is_refused_with_how_to_get_it():
    from lorarl.trainer.engines import ENGINES, Worker, register_engine

    register_engine("needs_missing", requires=("no_such_engine_module", "pip install no-such-engine"))(Worker)
    try:
        with pytest.raises(ConfigError, match=r"rollout\.engine=needs_missing needs no_such_engine_module, which this "
                                              r"Python \(.*\) cannot import: pip install no-such-engine"):  # fmt: skip
            load_config(None, ["rollout.engine=needs_missing"])
        load_config(None, ["rollout.engine=needs_missing", "trainer.backend=ray"])  # Ray may place it where it is
    finally:
        ENGINES.remove("needs_missing")


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "typo.yaml").write_text("trainer:\n  stpes: 3\n")
    with pytest.raises(ConfigError, match=r"trainer\.steps"):
        load_config(tmp_path / "typo.yaml")


def test_help_has_every_key_type_default_and_meaning():
    text = help_text()
    rank = "model.lora.rank                  int              16                 LoRA rank; 0 = full fine-tuning"
    assert rank in text
    assert "model.revision                   str | None       None" in text  # an optional value reads as such
    assert max(len(line) for line in text.splitlines()) <= 120  # wrapped to a terminal's width
    assert "rollout.engine" in text
    choices = text.split("rollout.engine: the registered choices")[1].splitlines()
    assert [line.split()[0] for line in choices[1:3]] == ["hf", "vllm"]
    assert "rollout.vllm.tensor_parallel_size" in text  # an engine's own settings, under its name
    assert "algorithm.clip_cov.ratio" in text  # a loss's
    assert "algorithm.max_sampling_rounds" in text
    assert "[1..]" in text


def test_a_single_value_where_a_list_is_expected_is_a_list_of_one(tmp_path):
    config = load_config(None, ["data.train_files=data/train.jsonl", "model.lora.target_modules=q_proj"])
    assert config.data.train_files == ["data/train.jsonl"]
    assert config.model.lora.target_modules == ["q_proj"]
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  val_files: data/val.jsonl\n")
    assert load_config(path).data.val_files == ["data/val.jsonl"]

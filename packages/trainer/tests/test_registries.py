"""The registries: a new estimator, loss, reward or engine is one decorated object in the user's own file, with its own
settings, loaded from the config by import path — which `--help` lists and the trainer trains with, without a wrapper
script and without touching trainer code."""

import json
import os
import re
import shlex
from pathlib import Path

import pytest
import torch
from trainer_fixtures import tiny_overrides

from lorarl.trainer.algorithms import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, policy_loss
from lorarl.trainer.cli import main
from lorarl.trainer.config import ConfigError, help_text, load_config
from lorarl.trainer.loop import Trainer
from lorarl.trainer.presets import PRESETS
from lorarl.trainer.registry import Plugin, PluginError, Registry, import_object

PLUGINS = '''
from dataclasses import dataclass

import torch

from lorarl.trainer.algorithms import register_advantage, register_policy_loss
from lorarl.trainer.algorithms.advantages import group_stats, per_token
from lorarl.trainer.engines import Completion, Worker, register_engine
from lorarl.trainer.registry import option
from lorarl.trainer.rewards import register_reward
from lorarl.weight_sync import SyncStats

CALLS = {"estimator": [], "loss": [], "reward": [], "engine": []}


@dataclass
class ScaleSettings:
    scale: float = option(1.0, "multiplies the group-centred rewards")


@register_advantage("scaled_centred", settings=ScaleSettings, compares_groups=True)
def scaled_centred(rewards, group_index, mask, *, scale):
    """scale x (r - the group's mean)."""
    CALLS["estimator"].append((rewards.clone(), scale))
    return per_token(scale * group_stats(rewards, group_index).centred(rewards), mask)


@dataclass
class WeightSettings:
    weight: float = option(1.0, "the policy gradient's weight")


@register_policy_loss("weighted_pg", settings=WeightSettings)
def weighted_pg(logp, old_logp, advantages, mask, clip, *, weight):
    """-weight x A x log pi: a plain policy gradient."""
    CALLS["loss"].append((advantages.detach().clone(), weight))
    return -weight * advantages * logp, torch.zeros_like(mask), torch.exp(logp - old_logp).detach()


@dataclass
class DigitSettings:
    digit: str = option("7", "the digit that scores")


@register_reward("says_digit", settings=DigitSettings)
def says_digit(prompt, response, answer, *, digit):
    """1 if the response says the digit."""
    CALLS["reward"].append(digit)
    return float(digit in response)


@dataclass
class ScriptSettings:
    tokens: list[int] = option([9, 5], "the token each response says, in turn (9: '7', 5: '3')")


@register_engine("scripted", settings=ScriptSettings)
class Scripted(Worker):
    """Says one token per response, in turn, then ends; keeps what it is sent."""

    def __init__(self, settings):
        self.tokens, self.eos, self.version = settings.own.tokens, settings.context.eos_token_id, 0

    def generate(self, prompts, sampling):
        return [Completion(i, (self.tokens[j % len(self.tokens)], self.eos), (-0.5, -0.5), True, self.version)
                for i in range(len(prompts)) for j in range(sampling.n)]

    def apply(self, update, *, shared=False):
        names = [name for name, _ in update.named()]
        CALLS["engine"].append((update.version, names, [spec.name for spec in update.specs]))
        self.version = update.version
        return SyncStats(update.version, len(names), 0, 0, 0.0)
'''


@pytest.fixture
def plugin_file(tmp_path):
    """The user's plugin file, loaded by import path only; its entries leave the registries after the test."""
    path = tmp_path / "my_plugins.py"
    path.write_text(PLUGINS)
    yield path
    from lorarl.trainer.engines import ENGINES
    from lorarl.trainer.rewards import REWARDS

    for registry, name in ((ADVANTAGES, "scaled_centred"), (POLICY_LOSSES, "weighted_pg"), (REWARDS, "says_digit"),
                           (ENGINES, "scripted")):  # fmt: skip
        if name in registry:
            registry.remove(name)


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def plugin_overrides(path) -> list[str]:
    return [f"algorithm.adv_estimator={path}:scaled_centred", "algorithm.scaled_centred.scale=2.0",
            f"algorithm.policy_loss={path}:weighted_pg", "algorithm.weighted_pg.weight=0.5",
            f"reward.fn={path}:says_digit", "reward.says_digit.digit=7",
            f"rollout.engine={path}:Scripted"]  # fmt: skip


def test_plugins_by_import_path_are_listed_with_their_settings_and_train_a_step(
    tiny_setup, tmp_path, plugin_file, capsys
):
    overrides = plugin_overrides(plugin_file)
    text = help_text(None, overrides)
    for key, meaning in [("algorithm.scaled_centred.scale", "multiplies the group-centred rewards"),
                         ("algorithm.weighted_pg.weight", "the policy gradient's weight"),
                         ("reward.says_digit.digit", "the digit that scores"),
                         ("rollout.scripted.tokens", "the token each response says")]:  # fmt: skip
        assert re.search(rf"^  {re.escape(key)} .*{re.escape(meaning)}", text, re.M), key
    assert main(["--help", *overrides]) == 0  # the command line's --help, with the config's plugins
    assert "algorithm.scaled_centred.scale" in capsys.readouterr().out

    config = load_config(None, tiny_overrides(tiny_setup, tmp_path / "out", trainer__steps=1) + overrides)
    assert (config.algorithm.scaled_centred.scale, config.algorithm.weighted_pg.weight) == (2.0, 0.5)
    trainer = Trainer(config)
    engine = trainer.start_engine()
    try:
        trainer.weights.sync()
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
        metrics = trainer.train_step(1)
    finally:
        engine.close()
    calls = import_object(f"{plugin_file}:CALLS")
    # the engine's responses alternate "7" and "3": the reward (its digit set to 7) scores half of them
    assert metrics["reward/mean"] == 0.5
    assert calls["reward"]
    assert set(calls["reward"]) == {"7"}
    ((rewards, scale),) = calls["estimator"]
    assert scale == 2.0
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0] * 8  # 8 prompts x 4 responses
    ((advantages, weight),) = calls["loss"]  # one micro-batch
    assert weight == 0.5
    first = advantages[:, 0].tolist()  # the micro-batch's rows, shuffled: scale x (r - the group's mean) = 2 x +-0.5
    assert sorted(first) == [-1.0] * 16 + [1.0] * 16
    assert metrics["grad_norm"] > 0
    assert any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters() if p.requires_grad)
    versions = [(version, names == announced) for version, names, announced in calls["engine"]]
    assert versions == [(0, True), (1, True)]  # the merged weights of the start and of step 1, as announced
    assert engine.version == 1


ENGINE_PLUGIN = """
import dataclasses
import os

from lorarl.trainer.engines import HFEngineSettings, register_engine
from lorarl.trainer.engines.hf import HFSettings, HFWorker
from lorarl.trainer.registry import option


@dataclasses.dataclass
class NotedSettings(HFEngineSettings):
    note: str = option("", "a file the engine writes its process id to")


@dataclasses.dataclass(frozen=True)
class NotedWorkerSettings(HFSettings):
    note: str = ""


@register_engine("noted_hf", settings=NotedSettings)
class NotedHF(HFWorker):
    \"\"\"The HF engine, which writes down the process it runs in.\"\"\"

    @classmethod
    def settings(cls, own, context):
        hf = super().settings(own, context)
        return NotedWorkerSettings(**{f.name: getattr(hf, f.name) for f in dataclasses.fields(hf)}, note=own.note)

    def __init__(self, settings):
        super().__init__(settings)
        with open(settings.note, "a") as f:
            f.write(f"{os.getpid()}\\n")
"""


@pytest.mark.parametrize("where", [{"rollout__worker": "process"}, {"trainer__backend": "ray"}], ids=["process", "ray"])
def test_a_plugin_engine_from_a_file_runs_in_a_process_or_ray_actor_of_its_own(tiny_setup, tmp_path, where):
    """Its class and settings come from a file no other process can import by name: they still reach the engine's."""
    if "trainer__backend" in where:
        pytest.importorskip("ray")
    from lorarl.trainer.engines import ENGINES

    path, notes, out = tmp_path / "noted_engine.py", tmp_path / "pids", tmp_path / "out"
    path.write_text(ENGINE_PLUGIN)
    overrides = [f"rollout.engine={path}:NotedHF", f"rollout.noted_hf.note={notes}"]
    try:
        assert main(tiny_overrides(tiny_setup, out, trainer__steps=2, **where) + overrides) == 0
    finally:
        if "noted_hf" in ENGINES:
            ENGINES.remove("noted_hf")
    (pid,) = notes.read_text().split()
    assert int(pid) != os.getpid()
    assert [record["step"] for record in records(out)] == [1, 2]


def test_a_value_from_a_plugin_file_reaches_a_spawned_process_which_loads_that_file_only(tmp_path):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from operator import attrgetter

    from lorarl.trainer.registry import Portable

    for name in ("used", "unused"):  # each notes the process that loads it
        note = f"import os\n\nwith open({str(tmp_path / name)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}} ')\n"
        (tmp_path / f"{name}.py").write_text(note + "\n\nclass Thing:\n    pass\n")
    used, _ = (import_object(f"{tmp_path / name}.py:Thing") for name in ("used", "unused"))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(attrgetter("value"), Portable((used, 3))).result() == (used, 3)
    assert len(set((tmp_path / "used").read_text().split())) == 2  # here and there
    assert (tmp_path / "unused").read_text().split() == [str(os.getpid())]  # here only


def test_the_readme_plugin_example_runs_as_written(tiny_setup, tmp_path, monkeypatch, capsys):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Plugins") :]
    code = re.search(r"```python\n(# my_plugins\.py\n.*?)```", section, re.S).group(1)
    commands = re.search(r"```bash\n(uv run trainer .*?)```", section, re.S).group(1).replace("\\\n", " ")
    train, show = (shlex.split(line, comments=True)[3:] for line in commands.splitlines())
    (tmp_path / "my_plugins.py").write_text(code)
    monkeypatch.chdir(tmp_path)  # the commands name the file relative to where they run
    try:
        assert main(tiny_overrides(tiny_setup, tmp_path / "out", trainer__steps=1) + train) == 0
        assert load_config(None, train).algorithm.scaled_centred.scale == 2.0
        capsys.readouterr()
        assert main(show) == 0
        assert "algorithm.scaled_centred.scale" in capsys.readouterr().out
    finally:
        for registry, name in ((ADVANTAGES, "scaled_centred"), (POLICY_LOSSES, "vanilla_pg")):
            if name in registry:
                registry.remove(name)
    assert records(tmp_path / "out")[-1]["step"] == 1


def test_a_settings_key_of_a_plugin_is_checked_like_any_key(tiny_setup, plugin_file):
    overrides = plugin_overrides(plugin_file)
    with pytest.raises(ConfigError, match=r"unknown key 'algorithm\.scaled_centred\.scael'; did you mean"):
        load_config(None, [*overrides, "algorithm.scaled_centred.scael=3"])
    with pytest.raises(ConfigError, match=r"algorithm\.weighted_pg\.weight"):
        load_config(None, [*overrides, "algorithm.weighted_pg.weight=heavy"])


def test_an_import_path_must_name_a_registered_piece_of_that_kind(tmp_path, plugin_file):
    (tmp_path / "plain.py").write_text("def estimator(rewards, group_index, mask):\n    return rewards\n")
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator=.*: estimator is not a registered advantage "
                                          r"estimator: decorate it"):  # fmt: skip
        load_config(None, [f"algorithm.adv_estimator={tmp_path / 'plain.py'}:estimator"])
    with pytest.raises(ConfigError, match=r"weighted_pg is not a registered advantage estimator"):
        load_config(None, [f"algorithm.adv_estimator={plugin_file}:weighted_pg"])
    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss=.*file .*missing\.py not found"):
        load_config(None, [f"algorithm.policy_loss={tmp_path / 'missing.py'}:loss"])
    with pytest.raises(ConfigError, match=r"rollout\.engine=.*cannot import no_such_module"):
        load_config(None, ["rollout.engine=no_such_module:Engine"])


def test_a_registry_names_what_it_holds_and_loads_by_import_path():
    registry: Registry[Plugin] = Registry("widget")
    assert registry.register("cog")(len) is len  # the decorated object, unchanged
    registry.register("sprocket")(abs)
    cog = registry["cog"]
    assert (cog.name, cog.target, cog("abc")) == ("cog", len, 3)
    assert list(registry) == ["cog", "sprocket"]
    assert "cog" in registry
    assert "cgo" not in registry
    with pytest.raises(ValueError, match="widget 'cog' is registered already"):
        registry.register("cog")(max)
    with pytest.raises(PluginError, match=re.escape("unknown widget 'cgo': expected one of cog, sprocket, or an import "
                                                    "path")):  # fmt: skip
        registry["cgo"]
    with pytest.raises(TypeError, match="unknown fields"):
        registry.register("gear", needs_values=True)
    assert registry.remove("cog") is cog
    assert list(registry) == ["sprocket"]
    assert ADVANTAGES["lorarl.trainer.algorithms.advantages:grpo"] is ADVANTAGES["grpo"]


def test_every_preset_names_registered_algorithms():
    for name, preset in PRESETS.items():
        settings = preset.settings
        assert settings["adv_estimator"] in ADVANTAGES, name
        assert settings["policy_loss"] in POLICY_LOSSES, name
    assert {"k1", "k2", "k3", "low_var_kl"} <= set(KL_ESTIMATORS)


def test_an_unregistered_estimator_is_rejected_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=re.escape("unknown advantage estimator 'toy_zero': expected one of grpo, "
                                                    "drgrpo, rloo")):  # fmt: skip
        load_config(None, ["algorithm.adv_estimator=toy_zero"])


def test_moved_keys_keep_working_and_say_their_new_name():
    with pytest.warns(FutureWarning) as said:
        config = load_config(None, ["algorithm.clip_cov_ratio=0.01", "rollout.batch_size=64"])
    assert [str(w.message) for w in said] == [
        "algorithm.clip_cov_ratio on the command line is now algorithm.clip_cov.ratio",
        "rollout.batch_size on the command line is now rollout.hf.batch_size",
    ]
    assert (config.algorithm.clip_cov.ratio, config.rollout.hf.batch_size) == (0.01, 64)
    with pytest.warns(FutureWarning, match="algorithm.gamma"):
        config = load_config(None, ["algorithm.gamma=0.9"])
    assert config.algorithm.gae.gamma == config.algorithm.reinforce_pp.gamma == 0.9


def test_a_registered_policy_loss_is_aggregated_and_measured_like_the_built_in_ones():
    from lorarl.trainer.algorithms import register_policy_loss

    @register_policy_loss("toy_vanilla_pg")
    def vanilla_pg(logp, old_logp, advantages, mask, clip):
        """-A·log π (the README's example)."""
        return -advantages * logp, torch.zeros_like(mask), torch.exp(logp - old_logp).detach()

    try:
        assert load_config(None, ["algorithm.policy_loss=toy_vanilla_pg"]).algorithm.policy_loss == "toy_vanilla_pg"
        generator = torch.Generator().manual_seed(0)
        logp = -torch.rand(3, 4, generator=generator, dtype=torch.float64)
        old = logp - 0.1
        advantages = torch.randn(3, 4, generator=generator, dtype=torch.float64)
        mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
        loss, metrics = policy_loss("toy_vanilla_pg", logp, old, advantages, mask, loss_agg_mode="seq-mean-token-mean")
        per_sequence = [sum(-advantages[i, t] * logp[i, t] for t in range(4) if mask[i, t]) / mask[i].sum() for i in
                        range(3)]  # fmt: skip
        assert float(loss) == pytest.approx(float(sum(per_sequence) / 3))
        assert metrics["clipfrac"] == 0.0
        assert metrics["ratio_mean"] == pytest.approx(float(torch.exp(torch.tensor(0.1))))
    finally:
        POLICY_LOSSES.remove("toy_vanilla_pg")


def test_a_plugin_file_copied_elsewhere_registers_its_names_again(tmp_path):
    """The same environment file in two runs' directories (each imported as a module of its own) registers its name
    twice: the newest is kept; another class under a taken name is still refused."""
    from lorarl.trainer.envs import ENVIRONMENTS
    from lorarl.trainer.registry import import_object

    source = (
        "from lorarl.trainer.envs import register_env\nfrom lorarl.trainer.envs.chat import ChatEnvironment\n\n\n"
        "@register_env('copied_twice')\nclass Copied(ChatEnvironment):\n    pass\n"
    )
    found = []
    for place in ("a", "b"):
        (tmp_path / place).mkdir()
        (tmp_path / place / "env.py").write_text(source)
        found.append(import_object(f"{tmp_path / place / 'env.py'}:Copied"))
    assert found[0] is not found[1]
    assert ENVIRONMENTS["copied_twice"].target is found[1]
    (tmp_path / "c.py").write_text(source.replace("    pass", "    turns = 2"))
    with pytest.raises(PluginError, match="'copied_twice' is registered already"):
        import_object(f"{tmp_path / 'c.py'}:Copied")
    ENVIRONMENTS.remove("copied_twice")

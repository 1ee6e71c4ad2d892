"""The algorithm registries: a new estimator, loss or KL estimator is one decorated function, which the config
accepts, `--help` lists and the trainer uses — without touching trainer code."""

import re
from typing import ClassVar

import pytest
import torch
from trainer_fixtures import tiny_overrides

from lorarl.trainer.algorithms import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, register_advantage
from lorarl.trainer.config import ConfigError, help_text, load_config
from lorarl.trainer.engines import ENGINES
from lorarl.trainer.loop import Trainer
from lorarl.trainer.presets import PRESETS
from lorarl.trainer.registry import Registry


def test_a_registry_names_what_it_holds():
    registry: Registry[int] = Registry("widget")
    registry.register("cog")(1)
    registry.register("sprocket")(2)
    assert list(registry) == ["cog", "sprocket"]
    assert "cog" in registry
    assert len(registry) == 2
    with pytest.raises(ValueError, match="widget 'cog' is registered already"):
        registry.register("cog")(3)
    with pytest.raises(
        ValueError, match=re.escape("unknown widget 'cgo': expected one of cog, sprocket; did you mean")
    ):
        registry["cgo"]
    assert registry.remove("cog") == 1
    assert list(registry) == ["sprocket"]


def test_every_preset_names_registered_algorithms():
    for name, preset in PRESETS.items():
        settings = preset.settings
        assert settings["adv_estimator"] in ADVANTAGES, name
        assert settings["policy_loss"] in POLICY_LOSSES, name
    assert {"k1", "k2", "k3", "low_var_kl"} <= set(KL_ESTIMATORS)


@pytest.fixture
def zero_advantages():
    """A toy estimator registered the way a user would: every advantage 0 (and a record of its calls)."""
    calls = []

    @register_advantage("toy_zero")
    def toy_zero(rewards, group_index, mask, **options):
        """No learning signal at all: what a broken estimator would give."""
        calls.append((rewards.clone(), options))
        return torch.zeros(mask.shape)

    yield calls
    ADVANTAGES.remove("toy_zero")


def test_a_registered_estimator_is_a_config_choice_and_drives_training(tiny_setup, tmp_path, zero_advantages):
    assert "toy_zero" in help_text()
    overrides = tiny_overrides(tiny_setup, tmp_path / "out", algorithm__adv_estimator="toy_zero")
    trainer = Trainer(load_config(None, overrides, presets=PRESETS))
    trainer.start_engine()
    try:
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
        metrics = trainer.train_step(1)
    finally:
        trainer.engine.close()
    ((rewards, options),) = zero_advantages
    assert rewards.numel() == 8 * 4
    assert options == {"norm_std": True, "gamma": 1.0, "lam": 1.0, "eps": 1e-6}
    assert float(rewards.mean()) == pytest.approx(metrics["reward/mean"])  # the step's scores (no shaping here)
    assert metrics["grad_norm"] == 0.0  # zero advantages: no gradient, and the adapter did not move
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, before[name]), name


def test_an_unregistered_estimator_is_rejected_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=re.escape("adv_estimator='toy_zero': expected one of grpo, drgrpo, rloo")):
        load_config(None, ["algorithm.adv_estimator=toy_zero"])


@pytest.fixture
def scripted_engine(tiny_setup):
    """A toy engine registered the way a user would: it answers every prompt "7" (then end of sequence) and keeps
    the names and versions of the weights it is sent."""
    from lorarl.trainer.engines import Completion, Worker, register_engine
    from lorarl.weight_sync import SyncStats

    class ScriptedWorker(Worker):
        received: ClassVar[list] = []  # what the worker was sent, across instances

        @classmethod
        def settings(cls, rollout, context):
            return context

        def __init__(self, context):
            self.version, self.eos = 0, context.eos_token_id

        def generate(self, prompts, n, temperature, top_p, max_tokens, seed):
            seven = 9  # "7" in the in-code character tokenizer
            return [Completion(i, (seven, self.eos), (-0.5, -0.5), True, self.version)
                    for i in range(len(prompts)) for _ in range(n)]  # fmt: skip

        def load_weights(self, named_tensors, version, manifest):
            names = [name for name, _ in named_tensors]
            self.received.append((version, names, [spec[0] for spec in manifest]))
            self.version = version
            return SyncStats(version, len(names), 0, 0, 0.0)

    register_engine("toy_scripted")(ScriptedWorker)
    yield ScriptedWorker
    ENGINES.remove("toy_scripted")


def test_a_registered_engine_is_a_config_choice_and_serves_the_trainer(tiny_setup, tmp_path, scripted_engine):
    from lorarl.lora_merge import merged_weight_specs

    assert "toy_scripted" in help_text()
    overrides = tiny_overrides(tiny_setup, tmp_path / "out", rollout__engine="toy_scripted")
    trainer = Trainer(load_config(None, overrides, presets=PRESETS))
    engine = trainer.start_engine()
    try:
        trainer.weights.sync()
        metrics = trainer.train_step(1)
    finally:
        engine.close()
    assert metrics["reward/mean"] == 1.0  # its "7"s, scored by the run's reward (the share of 7s in a response)
    assert metrics["response_length/mean"] == 2.0
    expected = [name for name, _, _ in merged_weight_specs(trainer.model)]
    assert [(version, names) for version, names, _ in scripted_engine.received] == [(0, expected), (1, expected)]
    assert all(announced == expected for _, _, announced in scripted_engine.received)
    assert engine.version == 1


def test_a_registered_policy_loss_is_aggregated_and_measured_like_the_built_in_ones():
    from lorarl.trainer.algorithms import policy_loss, register_policy_loss

    @register_policy_loss("toy_vanilla_pg")
    def vanilla_pg(logp, old_logp, advantages, mask, **options):
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

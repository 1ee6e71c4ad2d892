"""PPO with a LoRA critic: the critic's adapter and the policy's share one base and never change each other's outputs,
the values are the value head on the hidden state before each token in every layout, and `algorithm=ppo` trains,
checkpoints, resumes and exports (the critic left out of what the engine and the export see)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from trainer_fixtures import tiny_overrides

from lorarl.lora_merge import iter_merged_weights
from lorarl.trainer.cli import main
from lorarl.trainer.config import ConfigError, load_config
from lorarl.trainer.engines.hf import checksum
from lorarl.trainer.logprobs import micro_batch, response_logprobs, response_values
from lorarl.trainer.loop import Trainer
from lorarl.trainer.models import Critic, Policy
from lorarl.trainer.optim import Optimizer
from lorarl.trainer.presets import PRESETS

PROMPTS = [[3, 4, 5], [6, 7], [3, 4, 5], [8, 9, 10, 11]]
RESPONSES = [(5, 6, 7), (8,), (9, 10), (11, 12, 13, 14)]


def records(output_dir) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def policy_and_critic(tiny_setup, tmp_path, **extra) -> tuple[Policy, Critic]:
    config = load_config(None, tiny_overrides(tiny_setup, tmp_path, algorithm="ppo", **extra), presets=PRESETS)
    torch.manual_seed(0)
    policy = Policy(config.model, torch.device("cpu"), kl_coef=0.0)
    return policy, Critic(config.critic, policy, torch.device("cpu"))


def batch(layout: str, share_prompts: bool = False):
    width = max(map(len, RESPONSES))
    return micro_batch(PROMPTS, RESPONSES, width, "cpu", layout, share_prompts=share_prompts)


def values_of(critic: Critic, micro) -> torch.Tensor:
    with critic.selected() as model:
        return response_values(model, micro, critic.head)


def train(optimizer: Optimizer, loss_fn, steps: int = 3) -> None:
    for _ in range(steps):
        loss_fn().backward()
        optimizer.step()


def test_the_critic_and_the_policy_never_change_each_other_and_the_base_stays(tiny_setup, tmp_path):
    policy, critic = policy_and_critic(tiny_setup, tmp_path)
    assert critic.shares_base
    assert critic.model is policy.model
    model, micro = policy.model, batch("padded", share_prompts=True)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    assert {n for n, grad in flags.items() if grad} == set(policy.trainable_names) | set(critic.trainable_names)

    def logp() -> torch.Tensor:
        return response_logprobs(model, micro)[0]

    logp_before, merged_before, values_before = logp().detach(), dict(iter_merged_weights(model)), None
    values_before = values_of(critic, micro).detach()
    critic_optimizer = Optimizer(critic.trainable(), lr=0.05, weight_decay=0.0, grad_clip=0.0, warmup=0, total=3,
                                 schedule="constant")  # fmt: skip
    train(critic_optimizer, lambda: (values_of(critic, micro) - 1.0).square()[micro.mask].mean())
    values_after = values_of(critic, micro).detach()
    assert not torch.allclose(values_after, values_before)  # the critic learned ...
    assert torch.equal(logp().detach(), logp_before)  # ... and the policy's outputs did not move by a bit
    merged = dict(iter_merged_weights(model))
    assert merged.keys() == merged_before.keys()
    assert all(torch.equal(merged[k], v) for k, v in merged_before.items())  # what the engine gets, too

    actor_optimizer = Optimizer(policy.trainable(), lr=0.05, weight_decay=0.0, grad_clip=0.0, warmup=0, total=3,
                                schedule="constant")  # fmt: skip
    train(actor_optimizer, lambda: -logp()[micro.mask].mean())
    assert not torch.allclose(logp().detach(), logp_before)  # the policy learned ...
    assert torch.equal(values_of(critic, micro).detach(), values_after)  # ... and the values did not move by a bit

    with policy.reference() as reference:  # the base alone: a fresh copy of the model scores the same
        from transformers import AutoModelForCausalLM

        fresh = AutoModelForCausalLM.from_pretrained(tiny_setup["model"], dtype=torch.float32)
        torch.testing.assert_close(response_logprobs(reference, micro)[0], response_logprobs(fresh, micro)[0],
                                   rtol=0, atol=1e-6)  # fmt: skip
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if "lora_" not in n)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags  # no context flipped a flag


@pytest.mark.parametrize(("layout", "share_prompts"), [("packed", False), ("padded", False), ("padded", True)])
def test_values_are_the_head_on_the_hidden_state_before_each_token(tiny_setup, tmp_path, layout, share_prompts):
    """Against one sample at a time through the critic's base model: V_t = head(h at the position of token t-1), the
    alignment of the log-probs."""
    _, critic = policy_and_critic(tiny_setup, tmp_path)
    with torch.no_grad():
        critic.head.weight.normal_()  # values far from 0, so that a misalignment shows
        for name, p in critic.model.named_parameters():
            if ".critic." in name and "lora_B" in name:
                p.normal_(std=0.3)  # a trained-looking critic adapter (the policy's stays at B = 0)
        micro = batch(layout, share_prompts)
        values = values_of(critic, micro)
        expected, policy_side = torch.zeros_like(values), torch.zeros_like(values)
        for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
            ids = torch.tensor([prompt + list(response)])
            with critic.selected() as model:
                hidden = model.get_base_model().model(input_ids=ids).last_hidden_state[0]
            with_policy_adapter = critic.model.get_base_model().model(input_ids=ids).last_hidden_state[0]
            for t in range(len(response)):
                expected[i, t] = critic.head(hidden[len(prompt) + t - 1])[0]
                policy_side[i, t] = critic.head(with_policy_adapter[len(prompt) + t - 1])[0]
    assert values.abs().max() > 0.1
    torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-5)
    assert (values - policy_side).abs().max() > 1e-2  # the critic's adapter computed them, not the policy's
    assert torch.all(values[~micro.mask] == 0)  # nothing past each response


def test_a_critic_of_its_own_when_either_side_is_fully_trained(tiny_setup, tmp_path):
    """A fully trained policy keeps its critic apart (an adapter on a copy of the base); a LoRA policy with
    `critic.lora.rank=0` gets a fully trained copy. Both train and checkpoint."""
    for extra, expect_lora in [({"model__lora__rank": 0, "actor__lr": 1e-3}, True), ({"critic__lora__rank": 0}, False)]:
        out = tmp_path / f"rank-{expect_lora}"
        trainer = Trainer(load_config(None, tiny_overrides(tiny_setup, out, algorithm="ppo", trainer__steps=2,
                                                           **extra), presets=PRESETS))  # fmt: skip
        critic = trainer.critic
        assert not critic.shares_base
        assert critic.model is not trainer.model
        assert critic.is_lora == expect_lora
        before = {n: p.detach().clone() for n, p in critic.model.named_parameters() if p.requires_grad}
        trainer.run()
        assert all(r["critic/grad_norm"] > 0 for r in records(out) if "reward/mean" in r)
        assert any(not torch.equal(p, before[n]) for n, p in critic.model.named_parameters() if n in before)
        saved = out / "checkpoints" / "step_2" / "critic"
        assert (saved / ("adapter_model.safetensors" if expect_lora else "model.safetensors")).is_file()
        assert (saved / "value_head.safetensors").is_file()


def test_critic_settings_are_checked(tiny_setup, tmp_path):
    with pytest.raises(ConfigError, match=r"critic\.lora\.adapter_path"):
        policy_and_critic(tiny_setup, tmp_path, critic__lora__adapter_path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"critic\.lora\.rank=-1: expected a value >= 0"):
        policy_and_critic(tiny_setup, tmp_path, critic__lora__rank=-1)
    with pytest.raises(ConfigError, match=r"algorithm\.gae\.lam=1\.5: expected a value in \[0\.0, 1\.0\]"):
        load_config(None, ["algorithm.gae.lam=1.5"])


@pytest.fixture(scope="module")
def ppo_run(tiny_setup, tmp_path_factory):
    """`algorithm=ppo`, 12 steps, a checkpoint at 6 and at the end; shared by the tests that inspect it."""
    out = tmp_path_factory.mktemp("ppo") / "out"
    assert main(tiny_overrides(tiny_setup, out, algorithm="ppo", trainer__save_every=6)) == 0
    return out


def test_ppo_learns_and_its_critic_predicts_the_returns(ppo_run):
    steps = [r for r in records(ppo_run) if "reward/mean" in r]
    assert len(steps) == 12
    rewards = [r["reward/mean"] for r in steps]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1
    for key in ("critic/vf_loss", "critic/vf_explained_var", "critic/values_mean", "critic/vf_clipfrac",
                "critic/grad_norm", "critic/returns_mean", "loss", "grad_norm"):  # fmt: skip
        assert all(key in r for r in steps), key
    gap = [abs(r["critic/values_mean"] - r["critic/returns_mean"]) for r in steps]
    assert sum(gap[-3:]) < sum(gap[:3]) / 2  # the values (from ~0) came to the returns' scale


def test_the_checkpoint_holds_the_critic_and_the_export_leaves_it_out(ppo_run, tiny_setup, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint = ppo_run / "checkpoints" / "step_12"
    policy_tensors = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    assert not any("critic" in key for key in policy_tensors)
    assert not (checkpoint / "adapter" / "critic").exists()
    # the critic's adapter loads with peft onto the base, and its value head is beside it
    critic = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_setup["model"]),
                                       str(checkpoint / "critic"))  # fmt: skip
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in critic.named_parameters())
    assert load_file(checkpoint / "critic" / "value_head.safetensors")["weight"].shape == (1, 32)
    assert main(["export", "--checkpoint", str(checkpoint), "--merged", str(tmp_path / "merged")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_setup["model"]),
                                       str(checkpoint / "adapter"))  # fmt: skip
    for name, tensor in policy.merge_and_unload().state_dict().items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-6, atol=1e-6)


def test_a_resumed_ppo_run_repeats_the_uninterrupted_one(ppo_run, tiny_setup, tmp_path):
    """From step 6's checkpoint (the policy's and the critic's weights and optimizers): steps 7-12 again."""
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "checkpoints").symlink_to(ppo_run / "checkpoints")
    overrides = tiny_overrides(tiny_setup, resumed, algorithm="ppo", trainer__resume=str(ppo_run / "checkpoints" /
                                                                                          "step_6"))  # fmt: skip
    trainer = Trainer(load_config(None, overrides, presets=PRESETS))
    trainer.save = lambda step: None  # (the run's own checkpoints stay as they are)
    trainer.run()
    expected = [r for r in records(ppo_run) if r["step"] > 6]
    again = [r for r in records(resumed) if r["step"] > 6]
    assert [r["step"] for r in again] == list(range(7, 13))
    for a, b in zip(expected, again, strict=True):
        for key in ("reward/mean", "loss", "grad_norm", "critic/vf_loss", "critic/values_mean", "critic/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_the_engine_gets_the_policy_alone_and_the_actor_waits_for_the_critic(tiny_setup, tmp_path):
    """`critic.warmup_steps`: the first steps train the critic alone. Whatever the critic does, the engine holds the
    merge of the policy's adapter alone (peft's `merge_and_unload` of it, on a fresh base)."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    overrides = tiny_overrides(tiny_setup, tmp_path / "out", algorithm="ppo", critic__warmup_steps=1,
                               rollout__dtype="float32")  # fmt: skip
    trainer = Trainer(load_config(None, overrides, presets=PRESETS))
    policy = trainer.policy
    policy_before = [p.detach().clone() for p in policy.trainable()]
    trainer.start_engine()
    try:
        trainer.weights.sync()
        first = trainer.train_step(1)
        assert "grad_norm" not in first  # the critic alone
        assert first["critic/grad_norm"] > 0
        assert all(torch.equal(p, q) for p, q in zip(policy.trainable(), policy_before, strict=True))
        second = trainer.train_step(2)
        assert second["grad_norm"] > 0
        assert second["critic/grad_norm"] > 0
        fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_setup["model"], dtype=torch.float32),
                               trainer.model.peft_config["default"])  # fmt: skip
        set_peft_model_state_dict(fresh, get_peft_model_state_dict(trainer.model))  # the policy's adapter only
        assert trainer.engine.checksum() == checksum(iter_merged_weights(fresh, dtype=torch.float32))
    finally:
        trainer.engine.close()

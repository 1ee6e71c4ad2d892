"""A plugin's output is checked where it is called: one line naming the plugin (its file and name, as a config gives
it), what it returned and what was expected — for an estimator, a policy loss and a KL estimator; a well-formed
plugin passes through unchanged."""

import re

import pytest
import torch

from lorarl.trainer import algorithms
from lorarl.trainer.errors import TrainerError

PLUGINS = '''
import torch

from lorarl.trainer.algorithms import register_advantage, register_kl_estimator, register_policy_loss


@register_policy_loss("mean_only")
def mean_only(logp, old_logp, advantages, mask, clip):
    """Returns a scalar where per-token values belong."""
    ratio = torch.exp(logp - old_logp)
    return (-(advantages * ratio).mean(), torch.zeros_like(mask), ratio)


@register_policy_loss("two_things")
def two_things(logp, old_logp, advantages, mask, clip):
    return -advantages * logp, torch.zeros_like(mask)


@register_advantage("per_response")
def per_response(rewards, group_index, mask):
    return rewards - rewards.mean()  # [N], not [N, R]


@register_kl_estimator("listed")
def listed(log_ratio):
    return log_ratio.tolist()


@register_kl_estimator("fine")
def fine(log_ratio):
    return log_ratio.abs()
'''


@pytest.fixture
def plugins(tmp_path):
    path = tmp_path / "my_algos.py"
    path.write_text(PLUGINS)
    yield str(path)
    for registry, name in ((algorithms.POLICY_LOSSES, "mean_only"), (algorithms.POLICY_LOSSES, "two_things"),
                           (algorithms.ADVANTAGES, "per_response"), (algorithms.KL_ESTIMATORS, "listed"),
                           (algorithms.KL_ESTIMATORS, "fine")):  # fmt: skip
        if name in registry:
            registry.remove(name)


def inputs():
    generator = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 5, generator=generator)
    return logp, logp - 0.01, torch.randn(4, 5, generator=generator), torch.ones(4, 5, dtype=torch.bool)


def test_a_policy_loss_of_the_wrong_shape_is_named_with_what_it_returned(plugins):
    logp, old, adv, mask = inputs()
    expected = re.escape(f"policy loss mean_only ({plugins}:mean_only) returned a float32 tensor of shape () as "
                         "per_token; expected a float tensor of shape (4, 5)")  # fmt: skip
    with pytest.raises(TrainerError, match=expected):
        algorithms.policy_loss(f"{plugins}:mean_only", logp, old, adv, mask)
    with pytest.raises(TrainerError, match=re.escape(f"policy loss two_things ({plugins}:two_things) returned tuple; "
                                                     "expected (per_token, clipped, ratio)")):  # fmt: skip
        algorithms.policy_loss(f"{plugins}:two_things", logp, old, adv, mask)


def test_an_estimator_and_a_kl_estimator_of_the_wrong_output_are_named(plugins):
    logp, old, _, mask = inputs()
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1])
    wrong = f"advantage estimator per_response ({plugins}:per_response) returned a float32 tensor of shape (4,)"
    with pytest.raises(TrainerError, match=re.escape(wrong + " as advantages")):
        algorithms.advantages(f"{plugins}:per_response", rewards, groups, mask)
    with pytest.raises(TrainerError, match=re.escape(f"KL estimator listed ({plugins}:listed) returned list [[")):
        algorithms.kl_penalty(logp, old, f"{plugins}:listed")
    assert torch.equal(algorithms.kl_penalty(logp, old, f"{plugins}:fine"), (logp - old).abs())  # as returned


def test_the_built_in_pieces_name_their_module():
    assert algorithms.POLICY_LOSSES["ppo"].origin == "lorarl.trainer.algorithms.policy_losses:ppo"

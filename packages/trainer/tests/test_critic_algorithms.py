"""GAE and the clipped value loss (what PPO with a critic adds) against plain Python loops in float64."""

import random

import pytest
import torch

from lorarl.trainer.algorithms.critic import explained_variance, gae, last_token_rewards, value_loss


def inputs(seed: int, *, holes: bool):
    """Ragged responses (lengths 0..7 of width 7); with `holes`, some masked tokens inside a response too."""
    rng = random.Random(seed)
    mask = torch.zeros(5, 7, dtype=torch.bool)
    for i in range(5):
        mask[i, : rng.randint(0, 7)] = True
        if holes:
            mask[i, rng.randint(0, 6)] = False
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(5, 7, generator=generator, dtype=torch.float64) * mask
    values = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    return rewards, values, mask


def gae_reference(rewards, values, mask, gamma, lam):
    """The recursion over each response's valid tokens only, the value after the last one 0."""
    advantages = [[0.0] * 7 for _ in range(5)]
    returns = [[0.0] * 7 for _ in range(5)]
    for i in range(5):
        valid = [t for t in range(7) if mask[i, t]]
        running, next_value = 0.0, 0.0
        for t in reversed(valid):
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            running = delta + gamma * lam * running
            advantages[i][t], returns[i][t] = running, running + float(values[i, t])
            next_value = float(values[i, t])
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.0), (0.99, 0.95), (0.0, 0.7), (0.5, 1.0)])
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_gae_is_the_recursion(gamma, lam, holes, seed):
    rewards, values, mask = inputs(seed, holes=holes)
    advantages, returns = gae(rewards, values, mask, gamma=gamma, lam=lam)
    expected_advantages, expected_returns = gae_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, expected_advantages, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, expected_returns, rtol=1e-12, atol=1e-12)


def test_gamma_and_lambda_one_give_reward_to_go_minus_value():
    rewards, values, mask = inputs(7, holes=False)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    to_go = rewards.flip(1).cumsum(1).flip(1) * mask
    torch.testing.assert_close(returns, to_go, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(advantages, (to_go - values) * mask, rtol=1e-12, atol=1e-12)


def test_last_token_rewards_put_the_score_on_the_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    out = last_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert out.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_against_float64(clip, mode):
    _, values, mask = inputs(3, holes=False)
    generator = torch.Generator().manual_seed(1)
    old = values + 0.3 * torch.randn(5, 7, generator=generator, dtype=torch.float64)
    returns = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    loss, metrics = value_loss(values, old, returns, mask, clip=clip, loss_agg_mode=mode)
    per_token, clipped, rows = {}, 0, {}
    for i in range(5):
        for t in range(7):
            if not mask[i, t]:
                continue
            v, o, g = float(values[i, t]), float(old[i, t]), float(returns[i, t])
            plain = (v - g) ** 2
            bounded = plain if clip is None else (o + min(max(v - o, -clip), clip) - g) ** 2
            per_token[i, t] = max(plain, bounded)
            clipped += bounded > plain
            rows.setdefault(i, []).append(per_token[i, t])
    if mode == "token-mean":
        expected = 0.5 * sum(per_token.values()) / len(per_token)
    else:
        expected = 0.5 * sum(sum(r) / len(r) for r in rows.values()) / len(rows)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(clipped / len(per_token))


def test_explained_variance():
    _, values, mask = inputs(4, holes=False)
    assert explained_variance(values, values, mask) == pytest.approx(1.0)
    returns = torch.randn(5, 7, dtype=torch.float64)
    constant = torch.full_like(returns, float(returns[mask].mean()))
    assert explained_variance(constant, returns, mask) == pytest.approx(0.0, abs=1e-12)
    g, v = returns[mask], values[mask]
    assert explained_variance(values, returns, mask) == pytest.approx(float(1 - (g - v).var() / g.var()))


@pytest.mark.parametrize("seed", range(3))
def test_the_gae_estimator_whitens_gae_of_the_score_minus_the_per_token_penalty(seed):
    """`adv_estimator=gae`: the score on each response's last token, the KL penalty on every token (verl's
    token-level rewards with the KL in the reward), the recursion, then whitening over the valid tokens (unbiased std);
    the other estimators see the penalty summed per response."""
    from lorarl.trainer.algorithms import advantages

    _, values, mask = inputs(seed, holes=False)
    generator = torch.Generator().manual_seed(100 + seed)
    scores = torch.rand(5, generator=generator)
    penalty = torch.rand(5, 7, generator=generator) * 0.1
    values = values.float()
    out = advantages("gae", scores, torch.arange(5), mask, gamma=0.9, lam=0.8, values=values, token_penalty=penalty)
    token_rewards = -penalty.double() * mask
    for i in range(5):
        valid = [t for t in range(7) if mask[i, t]]
        if valid:
            token_rewards[i, valid[-1]] += float(scores[i])
    raw, _ = gae_reference(token_rewards, values.double(), mask, 0.9, 0.8)
    flat = [float(raw[i, t]) for i in range(5) for t in range(7) if mask[i, t]]
    mean = sum(flat) / len(flat)
    std = (sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)) ** 0.5
    expected = torch.where(mask, (raw - mean) / (std + 1e-6), 0.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    grpo_with = advantages("grpo", scores, torch.zeros(5, dtype=torch.long), mask, token_penalty=penalty)
    grpo_summed = advantages("grpo", scores - (penalty * mask).sum(1), torch.zeros(5, dtype=torch.long), mask)
    torch.testing.assert_close(grpo_with, grpo_summed)


def test_the_gae_estimator_asks_for_values():
    mask = torch.ones(2, 3, dtype=torch.bool)
    from lorarl.trainer.algorithms import advantages

    with pytest.raises(ValueError, match=r"gae needs values \[N, R\]"):
        advantages("gae", torch.ones(2), torch.arange(2), mask)

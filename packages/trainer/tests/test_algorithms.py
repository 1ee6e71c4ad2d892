"""Advantages, policy losses, aggregation and KL estimators against float64 references written from the formulas,
on random inputs with ragged masks, groups of one and ties."""

import math

import pytest
import torch

from lorarl.trainer.algorithms import ClipRange, advantages, aggregate, kl_penalty, policy_loss


def batch(seed=0, groups=(4, 4, 1, 3, 2), width=7):
    """Rewards with ties, group indices (a group of one included), a ragged response mask with an empty response."""
    g = torch.Generator().manual_seed(seed)
    group_index = torch.cat([torch.full((n,), i) for i, n in enumerate(groups)])
    rewards = torch.randint(0, 3, (len(group_index),), generator=g).float()  # ties
    lengths = torch.randint(0, width + 1, (len(group_index),), generator=g)
    lengths[0] = width
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return rewards, group_index, mask


def grpo_reference(rewards, group_index, mask, norm_std, eps, centre=True):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(len(rewards)):
        peers = [float(rewards[j]) for j in range(len(rewards)) if group_index[j] == group_index[i]]
        mean = sum(peers) / len(peers) if len(peers) > 1 else 0.0
        std = math.sqrt(sum((p - mean) ** 2 for p in peers) / (len(peers) - 1)) if len(peers) > 1 else 1.0
        a = float(rewards[i]) - (mean if centre else 0.0)
        if norm_std:
            a /= std + eps
        for t in range(mask.shape[1]):
            out[i, t] = a if mask[i, t] else 0.0
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("norm_std", [True, False])
def test_grpo_and_drgrpo(seed, norm_std):
    rewards, group_index, mask = batch(seed)
    got = advantages("grpo", rewards, group_index, mask, norm_std=norm_std)
    torch.testing.assert_close(got.double(), grpo_reference(rewards, group_index, mask, norm_std, 1e-6))
    dr = advantages("drgrpo", rewards, group_index, mask)
    torch.testing.assert_close(dr.double(), grpo_reference(rewards, group_index, mask, False, 1e-6))


@pytest.mark.parametrize("seed", range(5))
def test_rloo(seed):
    rewards, group_index, mask = batch(seed)
    expected = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(len(rewards)):
        others = [float(rewards[j]) for j in range(len(rewards)) if group_index[j] == group_index[i] and j != i]
        a = float(rewards[i]) - sum(others) / len(others) if others else 0.0
        expected[i] = torch.where(mask[i], a, 0.0)
    torch.testing.assert_close(advantages("rloo", rewards, group_index, mask).double(), expected)


def whiten(values, mask):
    valid = [float(v) for v, m in zip(values.flatten(), mask.flatten(), strict=True) if m]
    mean = sum(valid) / len(valid)
    std = math.sqrt(sum((v - mean) ** 2 for v in valid) / (len(valid) - 1))
    return torch.where(mask, (values - mean) / (std + 1e-6), 0.0)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp(seed, gamma):
    rewards, group_index, mask = batch(seed)
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(len(rewards)):
        length = int(mask[i].sum())
        for t in range(length):  # the score sits on the last token, discounted back along the response
            returns[i, t] = float(rewards[i]) * gamma ** (length - 1 - t)
    expected = whiten(returns, mask)
    torch.testing.assert_close(advantages("reinforce_pp", rewards, group_index, mask, gamma=gamma).double(), expected,
                               rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("seed", range(5))
def test_reinforce_pp_baseline(seed):
    rewards, group_index, mask = batch(seed)
    centred = grpo_reference(rewards, group_index, mask, norm_std=False, eps=0.0)
    for i in range(len(rewards)):  # a group of one: its mean is itself, so it centres to 0
        if (group_index == group_index[i]).sum() == 1:
            centred[i] = 0.0
    expected = whiten(centred, mask)
    got = advantages("reinforce_pp_baseline", rewards, group_index, mask).double()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def per_token_reference(name, logp, old, adv, clip_low, clip_high, dual_clip=None):
    out = torch.zeros_like(logp, dtype=torch.float64)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            ratio = math.exp(float(logp[i, t] - old[i, t]))
            a = float(adv[i, t])
            if name == "ppo":
                value = max(-a * ratio, -a * min(max(ratio, 1 - clip_low), 1 + clip_high))
                if dual_clip is not None and a < 0:
                    value = min(value, -a * dual_clip)
            else:  # cispo
                value = -a * min(ratio, 1 + clip_high) * float(logp[i, t])
            out[i, t] = value
    return out


def loss_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    _, _, mask = batch(seed)
    logp = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def aggregate_reference(values, mask, mode, norm_len=None):
    """The seq-mean modes average over the sequences with at least one valid token (as verl)."""
    rows = [[float(values[i, t]) for t in range(values.shape[1]) if mask[i, t]] for i in range(values.shape[0])]
    if mode.startswith("seq-mean"):
        rows = [row for row in rows if row]
    if mode == "token-mean":
        flat = [v for row in rows for v in row]
        return sum(flat) / max(len(flat), 1)
    if mode == "seq-mean-token-sum":
        return sum(sum(row) for row in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / max(len(row), 1) for row in rows) / len(rows)
    return sum(sum(row) / (norm_len or values.shape[1]) for row in rows) / len(rows)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("seed", range(3))
def test_aggregate_and_its_micro_batch_split(mode, seed):
    values, _, _, mask = loss_inputs(seed)
    assert aggregate(values, mask, mode).item() == pytest.approx(aggregate_reference(values, mask, mode), rel=1e-12)
    if mode == "seq-mean-token-sum-norm":
        assert aggregate(values, mask, mode, norm_len=3).item() == pytest.approx(
            aggregate_reference(values, mask, mode, norm_len=3), rel=1e-12
        )
    totals = {"total_tokens": float(mask.sum()), "total_sequences": float(mask.any(1).sum())}
    halves = [slice(0, 5), slice(5, None)]  # micro-batches with the whole batch's denominators add up to the batch
    split = sum(aggregate(values[h], mask[h], mode, **totals) for h in halves)
    assert split.item() == pytest.approx(aggregate(values, mask, mode).item(), rel=1e-12)


@pytest.mark.parametrize("name", ["ppo", "cispo"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("clips", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_and_cispo_match_the_formula(name, seed, clips):
    logp, old, adv, mask = loss_inputs(seed)
    loss, metrics = policy_loss(name, logp, old, adv, mask, clip=ClipRange(*clips))
    expected = aggregate_reference(per_token_reference(name, logp, old, adv, *clips), mask, "token-mean")
    assert loss.item() == pytest.approx(expected, rel=1e-10)
    assert 0 <= metrics["clipfrac"] <= 1
    assert metrics["approx_kl"] >= 0


@pytest.mark.parametrize("seed", range(3))
def test_dual_clip_caps_negative_advantages(seed):
    logp, old, adv, mask = loss_inputs(seed)
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed), dtype=logp.dtype)
    logp = old + noise * 2  # large ratios
    loss, _ = policy_loss("ppo", logp, old, adv, mask, clip=ClipRange(dual=3.0))
    expected = aggregate_reference(per_token_reference("ppo", logp, old, adv, 0.2, 0.2, 3.0), mask, "token-mean")
    assert loss.item() == pytest.approx(expected, rel=1e-10)


def test_gspo_value_and_gradient_of_its_token_form():
    logp, old, adv, mask = loss_inputs(1)
    adv = adv[:, :1].expand_as(adv).clone()  # GSPO: one advantage per sequence
    logp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss("gspo", logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    loss.backward()
    expected_value, expected_grad = 0.0, torch.zeros_like(logp)
    rows = [i for i in range(mask.shape[0]) if mask[i].any()]
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        if n == 0:
            continue
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in range(n)) / n)  # the sequence ratio
        a = float(adv[i, 0])
        clipped = min(max(s, 0.8), 1.2)
        expected_value += max(-a * s, -a * clipped) / mask.shape[0]
        unclipped_wins = -a * s >= -a * clipped
        for t in range(n):  # d/dlogp_t of the token form: -A * s (gradient flows only where not clipped)
            expected_grad[i, t] = (-a * s / n / mask.shape[0]) if unclipped_wins else 0.0
    assert rows
    assert loss.item() == pytest.approx(expected_value, rel=1e-9)
    torch.testing.assert_close(logp.grad, expected_grad, rtol=1e-9, atol=1e-12)


def test_cispo_gradient_is_the_detached_clipped_weight_times_advantage():
    logp, old, adv, mask = loss_inputs(2)
    logp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss("cispo", logp, old, adv, mask, clip=ClipRange(high=0.28))
    loss.backward()
    weight = torch.exp(logp.detach() - old).clamp(max=1.28)
    expected = torch.where(mask, -adv * weight / mask.sum(), 0.0)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators(kind):
    logp, ref, _, _ = loss_inputs(3)
    got = kl_penalty(logp, ref, kind)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            x = float(logp[i, t] - ref[i, t])
            expected = {"k1": x, "k2": 0.5 * x * x}.get(kind, min(max(math.exp(-x) + x - 1, -10), 10))
            assert got[i, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_k3_is_clamped_as_verl_does():
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([20.0]), "k3").item() == 10.0


def test_bad_names_are_rejected():
    rewards, group_index, mask = batch()
    with pytest.raises(ValueError, match="estimator"):
        advantages("ppo", rewards, group_index, mask)
    with pytest.raises(ValueError, match="response_mask"):
        advantages("grpo", rewards, group_index, mask[:3])
    with pytest.raises(ValueError, match="policy loss"):
        policy_loss("dpo", mask.float(), mask.float(), mask.float(), mask)
    with pytest.raises(ValueError, match="mode"):
        aggregate(mask.float(), mask, "sum")
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(mask.float(), mask.float(), "k4")

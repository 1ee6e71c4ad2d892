"""The rest of the catalogue (estimators OPO, GPG, pass@k; losses GPG, Clip-Cov, KL-Cov, GMPO, SAPO; token-sum;
KL abs, mse, k1+, k3+; token masking and sequence rejection), each against its formula computed by a plain Python
loop in float64 — and the fixes: a group whose rewards are all equal has advantage exactly 0, whatever the value."""

import math
import random

import pytest
import torch

from lorarl.trainer.algorithms import (
    ADVANTAGES,
    ClipRange,
    advantages,
    aggregate,
    kl_penalty,
    policy_loss,
    rollout_is_weights,
)

# (reinforce_pp_baseline centres groups exactly too, then whitens over the batch, which moves every zero)
GROUP_RELATIVE = ["grpo", "drgrpo", "rloo", "opo", "gpg", "grpo_passk"]


def ragged(sizes: list[int], width: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Group indices for groups of `sizes`, and a response mask of random lengths 1..width."""
    rng = random.Random(seed)
    group = torch.tensor([g for g, size in enumerate(sizes) for _ in range(size)])
    lengths = [rng.randint(1, width) for _ in group]
    mask = torch.tensor([[t < n for t in range(width)] for n in lengths])
    return group, mask


@pytest.mark.parametrize("estimator", GROUP_RELATIVE)
@pytest.mark.parametrize("seed", range(5))
def test_a_group_of_equal_rewards_has_advantage_exactly_zero(estimator, seed):
    rng = random.Random(seed)
    sizes = [rng.randint(2, 64) for _ in range(4)]
    group, mask = ragged(sizes, seed=seed)
    values = [rng.choice([0.1, 2.2, -0.7, 1 / 3, 1e6 + 0.1, rng.uniform(-5, 5)]) for _ in sizes]
    rewards = torch.tensor([values[g] for g in group.tolist()], dtype=torch.float32)
    rewards[: sizes[0]] = torch.rand(sizes[0])  # one group that differs, so batch statistics are not degenerate
    out = advantages(estimator, rewards, group, mask)
    tied = group != 0
    assert torch.equal(out[tied], torch.zeros_like(out[tied])), estimator


def test_the_issue_examples_give_zero():
    for value, size in ((0.1, 8), (2.2, 64)):
        rewards, group = torch.full((size,), value), torch.zeros(size, dtype=torch.long)
        mask = torch.ones(size, 3, dtype=torch.bool)
        for estimator in ("grpo", "drgrpo", "rloo", "opo"):
            assert torch.count_nonzero(advantages(estimator, rewards, group, mask)) == 0, (estimator, value)


def groups_of(group: torch.Tensor) -> dict[int, list[int]]:
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group.tolist()):
        members.setdefault(g, []).append(i)
    return members


def test_opo_gpg_and_passk_against_their_formulas():
    group, mask = ragged([5, 3, 1, 4], seed=3)
    rewards = torch.tensor([0.3, 1.0, 0.0, 0.7, 0.2, 1.0, 0.0, 0.5, 0.9, 0.0, 0.0, 0.4, 0.8])
    r = rewards.double().tolist()
    lengths = mask.sum(1).tolist()
    expected_opo, expected_gpg, expected_passk = [0.0] * len(r), [0.0] * len(r), [0.0] * len(r)
    alpha = len(r) / sum(1 for x in r if x != 0)
    for members in groups_of(group).values():
        n = len(members)
        mean = sum(r[i] for i in members) / n if n > 1 else 0.0
        baseline = sum(lengths[i] * r[i] for i in members) / sum(lengths[i] for i in members) if n > 1 else 0.0
        for i in members:
            expected_opo[i] = r[i] - baseline
            expected_gpg[i] = alpha * (r[i] - mean)
        if n > 1:
            ranked = sorted(members, key=lambda i: -r[i])
            std = math.sqrt(sum((r[i] - mean) ** 2 for i in members) / (n - 1))
            expected_passk[ranked[0]] = (r[ranked[0]] - r[ranked[1]]) / (std + 1e-6)
    for name, expected in (("opo", expected_opo), ("gpg", expected_gpg)):
        out = advantages(name, rewards, group, mask)
        torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32)[:, None] * mask)
    keep = group != 2  # pass@k needs two responses per group
    out = advantages("grpo_passk", rewards[keep], group[keep], mask[keep])
    torch.testing.assert_close(out, torch.tensor(expected_passk)[keep].float()[:, None] * mask[keep])
    with pytest.raises(ValueError, match="at least 2 responses per group"):
        advantages("grpo_passk", rewards, group, mask)


def test_every_estimator_is_registered_with_its_paper():
    for name in ("grpo", "drgrpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_pp", "reinforce_pp_baseline"):
        assert name in ADVANTAGES
        assert "20" in ADVANTAGES[name].target.__doc__, name  # a year: the paper is named


def loss_inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    logp = (-torch.rand(4, 5, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(4, 5, generator=generator, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2], dtype=torch.float64)[:, None].expand(4, 5).clone() * mask
    return logp, old, adv, mask


def seq_mean_token_mean(values: list[list[float]], mask: torch.Tensor) -> float:
    rows = [[v for v, m in zip(row, mrow, strict=True) if m] for row, mrow in zip(values, mask.tolist(), strict=True)]
    rows = [row for row in rows if row]  # sequences with no valid token do not count
    return sum(sum(row) / len(row) for row in rows) / len(rows)


def test_token_sum_and_seq_means_skip_fully_masked_responses():
    *_, mask = loss_inputs()
    values = torch.randn(4, 5, dtype=torch.float64)
    assert float(aggregate(values, mask, "token-sum")) == pytest.approx(float(values[mask].sum()))
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        with_empty = float(aggregate(values, mask, mode))
        without = float(aggregate(values[[0, 1, 3]], mask[[0, 1, 3]], mode))
        assert with_empty == pytest.approx(without), mode  # the empty row changes nothing
    assert float(aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx(
        seq_mean_token_mean(values.tolist(), mask)
    )


def test_gpg_sapo_and_gmpo_against_their_formulas():
    logp, old, adv, mask = loss_inputs()
    lp, o, a = logp.detach().tolist(), old.tolist(), adv.tolist()

    loss, _ = policy_loss("gpg", logp, old, adv, mask, loss_agg_mode="token-mean")
    expected = sum(-a[i][t] * lp[i][t] for i in range(4) for t in range(5) if mask[i, t]) / int(mask.sum())
    assert loss.item() == pytest.approx(expected)

    def gate(ratio, advantage):
        tau = 1.0 if advantage > 0 else 1.05
        return 1 / (1 + math.exp(-tau * (ratio - 1))) * 4 / tau

    loss, _ = policy_loss("sapo", logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean",
                          settings={"tau_pos": 1.0, "tau_neg": 1.05})  # fmt: skip
    per_token = [[-a[i][t] * gate(math.exp(lp[i][t] - o[i][t]), a[i][t]) for t in range(5)] for i in range(4)]
    assert loss.item() == pytest.approx(seq_mean_token_mean(per_token, mask))

    loss, metrics = policy_loss("gmpo", logp, old, adv, mask, clip=ClipRange(0.2, 0.28),
                                loss_agg_mode="seq-mean-token-mean")  # fmt: skip
    sequences = []
    for i in range(4):
        valid = [t for t in range(5) if mask[i, t]]
        if not valid:
            continue
        sign = 1 if a[i][valid[0]] > 0 else -1 if a[i][valid[0]] < 0 else 0
        clipped = [sign * min(sign * x, sign * min(max(x, -0.2), 0.28)) for x in (lp[i][t] - o[i][t] for t in valid)]
        ratio = math.exp(sum(clipped) / len(valid))
        sequences.append(-sum(a[i][t] for t in valid) / len(valid) * ratio)
    assert loss.item() == pytest.approx(sum(sequences) / len(sequences))
    assert 0 < metrics["clipfrac"] < 1


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    logp, old, adv, mask = loss_inputs(seed=1)
    lp = logp.detach()
    valid = [(i, t) for i in range(4) for t in range(5) if mask[i, t]]
    mean_a = sum(float(adv[i, t]) for i, t in valid) / len(valid)
    mean_l = sum(float(lp[i, t]) for i, t in valid) / len(valid)
    cov = {(i, t): (float(adv[i, t]) - mean_a) * (float(lp[i, t]) - mean_l) for i, t in valid}
    top = sorted(valid, key=lambda k: -cov[k])[:2]  # ratio 0.2 of 10 tokens
    loss, metrics = policy_loss("kl_cov", logp, old, adv, mask, loss_agg_mode="token-sum",
                                settings={"ratio": 0.2, "coef": 0.7})  # fmt: skip
    expected = 0.0
    for i, t in valid:
        log_ratio = float(lp[i, t] - old[i, t])
        expected += -float(adv[i, t]) * math.exp(log_ratio) + (0.7 * abs(log_ratio) if (i, t) in top else 0.0)
    assert loss.item() == pytest.approx(expected)
    assert metrics["clipfrac"] == pytest.approx(2 / len(valid))


def test_clip_cov_cuts_the_gradient_of_a_few_mid_covariance_tokens():
    torch.manual_seed(0)
    logp, old, adv, mask = loss_inputs(seed=2)
    adv = adv * 8  # covariances of order 1, some inside (lb, ub)
    options = {"ratio": 0.2, "lb": 0.05, "ub": 50.0}
    loss, _ = policy_loss("clip_cov", logp, old, adv, mask, loss_agg_mode="token-sum", settings=options)  # fmt: skip
    loss.backward()
    plain, _ = policy_loss("ppo", logp.detach().requires_grad_(), old, adv, mask, loss_agg_mode="token-sum")
    ratio = torch.exp(logp.detach() - old)
    clipped_by_ppo = (-adv * ratio.clamp(0.8, 1.2)) > (-adv * ratio)
    cut = [(i, t) for i in range(4) for t in range(5) if mask[i, t] and float(logp.grad[i, t]) == 0.0
           and not clipped_by_ppo[i, t]]  # fmt: skip
    assert len(cut) == 2  # max(int(0.2 * 10 tokens), 1)
    for i, t in cut:  # each a candidate: its covariance inside the band
        assert 0.05 < float(adv[i, t] - adv[mask].mean()) * float(logp.detach()[i, t] - logp.detach()[mask].mean()) < 50
    assert plain.item() != loss.item()


@pytest.mark.parametrize("name", ["k1+", "k3+"])
def test_straight_through_kl_has_its_value_and_k2s_gradient(name):
    logp = torch.tensor([-0.3, -1.2, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.5, -0.9, -2.4], dtype=torch.float64)
    value = kl_penalty(logp, ref, name)
    torch.testing.assert_close(value, kl_penalty(logp, ref, name[:2]))
    (gradient,) = torch.autograd.grad(value.sum(), logp)
    torch.testing.assert_close(gradient, (logp - ref).detach())  # d/dx x²/2
    x = (logp - ref).detach()
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), x.abs())
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), 0.5 * x.square())


def test_token_masking_and_sequence_rejection_keep_what_lies_in_the_band():
    _, old, _, mask = loss_inputs(seed=4)
    rollout = old + torch.tensor([[0.1, -0.9, 0.2, 0, 0], [0.01] * 5, [0.0] * 5, [1.0, 0.2, 0, 0, 0]]).double()
    band = (0.5, 2.0)
    token = rollout_is_weights(old, rollout, mask, "token_mask", 2.0, band)
    sequence = rollout_is_weights(old, rollout, mask, "sequence_reject", 2.0, band)
    for i in range(4):
        product = math.exp(sum(float(old[i, t] - rollout[i, t]) for t in range(5) if mask[i, t]))
        for t in range(5):
            rho = math.exp(float(old[i, t] - rollout[i, t]))
            assert float(token[i, t]) == float(bool(mask[i, t]) and band[0] <= rho <= band[1])
            assert float(sequence[i, t]) == float(bool(mask[i, t]) and band[0] <= product <= band[1])
    with pytest.raises(ValueError, match="band"):
        rollout_is_weights(old, rollout, mask, "token_mask", 2.0, (1.5, 2.0))


def test_remax_subtracts_the_greedy_score_and_insists_on_it():
    group, mask = ragged([3, 2], seed=5)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0])
    baseline = torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0])
    out = advantages("remax", rewards, group, mask, baseline=baseline)
    torch.testing.assert_close(out, (rewards - baseline)[:, None] * mask)
    with pytest.raises(ValueError, match="remax needs baseline"):
        advantages("remax", rewards, group, mask)

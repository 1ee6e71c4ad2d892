"""Advantage estimators: one score per response in, per-token advantages `[N, R]` out (zero on masked tokens).

Each estimator is an `AdvantageEstimator` registered under its config name (`algorithm.adv_estimator`), with its own
settings (`algorithm.<name>.*`), which it takes as keywords, and what else it needs declared as fields:
`needs_greedy_baseline` (each prompt's greedy score, as `baseline`), `needs_values` (a critic's values, as `values`, and
the per-token penalty as it is, `token_penalty`; the others see its sum per response), `compares_groups` (a baseline
from the other responses to the prompt: `rollout.n` must be >= 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lorarl.trainer.algorithms.aggregation import checked_output
from lorarl.trainer.algorithms.critic import gae_returns, last_token_rewards
from lorarl.trainer.lazy import torch
from lorarl.trainer.registry import Plugin, Registry, option

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class AdvantageEstimator(Plugin):
    compares_groups: bool = False  # its baseline comes from the prompt's other responses
    needs_values: bool = False  # it takes a critic's values (the trainer then trains one)
    needs_greedy_baseline: bool = False  # it takes each prompt's greedy score


ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator", AdvantageEstimator)
register_advantage = ADVANTAGES.register


def advantages(
    estimator: str | AdvantageEstimator,
    rewards: Tensor,
    group_index: Tensor,
    response_mask: Tensor,
    *,
    baseline: Tensor | None = None,
    values: Tensor | None = None,
    token_penalty: Tensor | None = None,
    **settings,
) -> Tensor:
    """Per-token advantages `[N, R]` (zero on masked tokens) from one score per response (`rewards [N]`), by the
    estimator registered as `estimator`, with its `settings` (the defaults of its settings dataclass for those not
    given). `baseline` `[N]`: the score of the prompt's greedy response, for the estimators that ask for it (ReMax);
    `values` `[N, R]`: the critic's, for those that need them (GAE). `token_penalty` `[N, R]` is subtracted from the
    rewards (the KL with `kl_in_reward`): per token where the estimator takes values, else summed per response."""
    entry = ADVANTAGES[estimator]
    mask = response_mask.bool()
    if rewards.dim() != 1 or group_index.shape != rewards.shape or mask.dim() != 2 or mask.shape[0] != rewards.numel():
        raise ValueError(
            f"expected rewards [N], group_index [N], response_mask [N, R]; got {tuple(rewards.shape)}, "
            f"{tuple(group_index.shape)}, {tuple(response_mask.shape)}"
        )
    if entry.needs_greedy_baseline and (baseline is None or baseline.shape != rewards.shape):
        raise ValueError(f"{entry.name} needs baseline [N] (each prompt's greedy score), got "
                         f"{None if baseline is None else tuple(baseline.shape)}")  # fmt: skip
    if entry.needs_values and (values is None or values.shape != mask.shape):
        raise ValueError(f"{entry.name} needs values [N, R] (a critic's), got "
                         f"{None if values is None else tuple(values.shape)}")  # fmt: skip
    rewards = rewards.to(torch.float32)
    if token_penalty is not None and not entry.needs_values:
        rewards, token_penalty = rewards - (token_penalty * mask).sum(1), None
    options = entry.keywords(settings)
    if entry.needs_greedy_baseline:
        options["baseline"] = baseline
    if entry.needs_values:
        options.update(values=values, token_penalty=token_penalty)
    return checked_output(
        entry, "advantage estimator", entry(rewards, group_index, mask, **options), mask.shape, "advantages"
    )


@dataclass
class GroupNormSettings:
    norm_std: bool = option(True, "divide the group-centred rewards by the group's std")
    eps: float = option(1e-6, "added to the std before dividing", minimum=0.0)


@dataclass
class WhitenSettings:
    eps: float = option(1e-6, "added to the batch's std before whitening", minimum=0.0)


@dataclass
class DiscountSettings:
    gamma: float = option(1.0, "discount along the response", minimum=0.0, maximum=1.0)
    eps: float = option(1e-6, "added to the batch's std before whitening", minimum=0.0)


@dataclass
class GaeSettings:
    gamma: float = option(1.0, "discount along the response", minimum=0.0, maximum=1.0)
    lam: float = option(1.0, "GAE's lambda: 1 = Monte-Carlo returns minus the value, 0 = one-step TD", minimum=0.0,
                        maximum=1.0)  # fmt: skip
    eps: float = option(1e-6, "added to the batch's std before whitening", minimum=0.0)


@dataclass(frozen=True)
class GroupStats:
    """Per sample, its group's statistics, in float64: the mean, the unbiased std (1 for a group of one), the size,
    and whether every reward of the group is the same (`tied`: then every group-relative advantage is exactly 0 — a
    float mean is an ulp off the rewards it averages, and an ulp divided by a std of ~0 + eps was up to ±0.6)."""

    mean: Tensor
    std: Tensor
    size: Tensor
    tied: Tensor

    def centred(self, rewards: Tensor) -> Tensor:
        """r - the group mean, exactly 0 in tied groups (a group of one keeps r: its mean counts as 0)."""
        rewards = rewards.double()
        return torch.where(self.tied & (self.size > 1), 0.0, torch.where(self.size > 1, rewards - self.mean, rewards))


def group_stats(rewards: Tensor, group_index: Tensor) -> GroupStats:
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    rewards = rewards.double()
    groups = counts.numel()
    sums = torch.zeros(groups, dtype=torch.float64, device=rewards.device).index_add_(0, inverse, rewards)
    means = sums / counts
    squares = torch.zeros_like(sums).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
    std = torch.where(counts > 1, (squares / (counts - 1).clamp(min=1)).sqrt(), torch.ones_like(sums))
    low = torch.full_like(sums, torch.inf).scatter_reduce(0, inverse, rewards, "amin")
    high = torch.full_like(sums, -torch.inf).scatter_reduce(0, inverse, rewards, "amax")
    tied = (low == high)[inverse]
    return GroupStats(means[inverse], std[inverse], counts[inverse], tied)


def whiten(values: Tensor, mask: Tensor, eps: float) -> Tensor:
    """`values` centred and scaled by the mean and std of its unmasked entries (zero where masked)."""
    valid = values[mask]
    if valid.numel() < 2:
        return values * mask
    return (values - valid.mean()) / (valid.std() + eps) * mask


def per_token(score: Tensor, mask: Tensor) -> Tensor:
    """One score per response `[N]` (float64) on each of its tokens, as float32 `[N, R]`."""
    return score.float()[:, None] * mask


@register_advantage("grpo", settings=GroupNormSettings, compares_groups=True)
def grpo(rewards: Tensor, group_index: Tensor, mask: Tensor, *, norm_std: bool, eps: float) -> Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A = (r - mean_group) / (std_group + eps), unbiased std; without
    `norm_std`, r - mean_group. A group of one has mean 0 and std 1."""
    stats = group_stats(rewards, group_index)
    centred = stats.centred(rewards)
    return per_token(centred / (stats.std + eps) if norm_std else centred, mask)


@register_advantage("drgrpo", compares_groups=True)
def drgrpo(rewards: Tensor, group_index: Tensor, mask: Tensor) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A = r - mean_group, no std division."""
    return per_token(group_stats(rewards, group_index).centred(rewards), mask)


@register_advantage("rloo", compares_groups=True)
def rloo(rewards: Tensor, group_index: Tensor, mask: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A = r - the mean of the other responses of the group = n/(n-1) (r - mean)."""
    stats = group_stats(rewards, group_index)
    scale = torch.where(stats.size > 1, stats.size / (stats.size - 1).clamp(min=1), 0.0)
    return per_token(stats.centred(rewards) * scale, mask)


@register_advantage("opo", compares_groups=True)
def opo(rewards: Tensor, group_index: Tensor, mask: Tensor) -> Tensor:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"): A = r - Σ|y|·r / Σ|y| over the group,
    the length-weighted baseline that minimises the gradient's variance (a group of one: baseline 0)."""
    stats = group_stats(rewards, group_index)
    lengths = mask.sum(1).double()
    weighted, total = group_stats(lengths * rewards.double(), group_index).mean, group_stats(lengths, group_index).mean
    baseline = torch.where((stats.size > 1) & (total > 0), weighted / total, 0.0)  # Σ|y|r / Σ|y|: the sizes cancel
    return per_token(torch.where(stats.tied & (stats.size > 1), 0.0, rewards.double() - baseline), mask)


@register_advantage("gpg", compares_groups=True)
def gpg(rewards: Tensor, group_index: Tensor, mask: Tensor) -> Tensor:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline"): A = α (r - mean_group),
    α = N / (responses with a non-zero reward), which rescales a batch diluted by zero-reward groups. Meant for the
    `gpg` policy loss (no ratio, no clip)."""
    alpha = rewards.numel() / max(int(torch.count_nonzero(rewards)), 1)
    return per_token(alpha * group_stats(rewards, group_index).centred(rewards), mask)


@register_advantage("grpo_passk", settings=GroupNormSettings, compares_groups=True)
def grpo_passk(rewards: Tensor, group_index: Tensor, mask: Tensor, *, norm_std: bool, eps: float) -> Tensor:
    """Pass@k training (Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and Exploitation"
    arXiv:2503.19595 as verl implements it): only the best response of each group learns, with A = r_max - r_second
    (divided by the group's std + eps with `norm_std`); every other response gets 0."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    if int(counts.min()) < 2:
        raise ValueError(f"grpo_passk needs at least 2 responses per group (rollout.n), got {int(counts.min())}")
    stats = group_stats(rewards, group_index)
    score = torch.zeros(rewards.numel(), dtype=torch.float64)
    for group in range(counts.numel()):
        members = torch.nonzero(inverse == group)[:, 0]
        top = rewards.double()[members].topk(2)
        best = members[top.indices[0]]
        score[best] = (top.values[0] - top.values[1]) / ((stats.std[best] + eps) if norm_std else 1.0)
    return per_token(score, mask)


@register_advantage("reinforce_pp", settings=DiscountSettings)
def reinforce_pp(rewards: Tensor, group_index: Tensor, mask: Tensor, *, gamma: float, eps: float) -> Tensor:
    """REINFORCE++ (Hu 2025): the score on the last response token, returns discounted by `gamma` along the
    response's valid tokens (an episode's environment tokens are skipped, not counted), whitened over the batch's
    tokens."""
    token_rewards = last_token_rewards(rewards, mask)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(mask.shape[0], dtype=torch.float32, device=rewards.device)
    for t in reversed(range(mask.shape[1])):
        running = torch.where(mask[:, t].bool(), token_rewards[:, t] + gamma * running, running)  # holes skipped
        returns[:, t] = running
    return whiten(returns * mask, mask, eps)


@register_advantage("remax", needs_greedy_baseline=True)
def remax(rewards: Tensor, group_index: Tensor, mask: Tensor, *, baseline: Tensor) -> Tensor:
    """ReMax (Li et al. 2024, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
    LLMs"): A = r - r(greedy response to the same prompt), on every token. The trainer samples that greedy response
    with each batch (one more generation per prompt)."""
    return per_token(rewards.double() - baseline.double(), mask)


@register_advantage("reinforce_pp_baseline", settings=WhitenSettings, compares_groups=True)
def reinforce_pp_baseline(rewards: Tensor, group_index: Tensor, mask: Tensor, *, eps: float) -> Tensor:
    """REINFORCE++-baseline (Hu 2025): r - mean_group at every token, whitened over the batch's tokens."""
    stats = group_stats(rewards, group_index)
    centred = torch.where(stats.size > 1, stats.centred(rewards), 0.0)  # a group of one: r - r
    return whiten(per_token(centred, mask), mask, eps)


@register_advantage("gae", settings=GaeSettings, needs_values=True)
def gae(rewards: Tensor, group_index: Tensor, mask: Tensor, *, values: Tensor, gamma: float, lam: float, eps: float,
        token_penalty: Tensor | None = None) -> Tensor:  # fmt: skip
    """PPO's GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation") on a critic's values: the score on the last token minus the per-token penalty, whitened over the
    batch's tokens (as verl's `compute_gae_advantage_return`)."""
    advantages, _ = gae_returns(rewards, values, mask, gamma=gamma, lam=lam, token_penalty=token_penalty)
    return whiten(advantages, mask, eps)

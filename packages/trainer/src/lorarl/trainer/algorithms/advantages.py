"""Advantage estimators: one score per response in, per-token advantages `[N, R]` out (zero on masked tokens).

Each estimator is a function registered under its config name (`algorithm.adv_estimator`); `advantages()` checks the
inputs once and calls it with every option (`norm_std`, `gamma`, `eps`), which it takes by keyword or ignores (`**_`).
"""

from collections.abc import Callable

import torch
from torch import Tensor

from lorarl.trainer.registry import Registry

AdvantageEstimator = Callable[..., Tensor]
ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator")
register_advantage = ADVANTAGES.register


def advantages(
    estimator: str,
    rewards: Tensor,
    group_index: Tensor,
    response_mask: Tensor,
    *,
    norm_std: bool = True,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """Per-token advantages `[N, R]` (zero on masked tokens) from one score per response (`rewards [N]`), by the
    estimator registered as `estimator`."""
    fn = ADVANTAGES[estimator]
    mask = response_mask.bool()
    if rewards.dim() != 1 or group_index.shape != rewards.shape or mask.dim() != 2 or mask.shape[0] != rewards.numel():
        raise ValueError(
            f"expected rewards [N], group_index [N], response_mask [N, R]; got {tuple(rewards.shape)}, "
            f"{tuple(group_index.shape)}, {tuple(response_mask.shape)}"
        )
    return fn(rewards.to(torch.float32), group_index, mask, norm_std=norm_std, gamma=gamma, eps=eps)


def group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sample: its group's mean, unbiased std, and size."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    groups = counts.numel()
    sums = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    means = sums / counts
    squares = torch.zeros_like(sums).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
    std = torch.where(counts > 1, (squares / (counts - 1).clamp(min=1)).sqrt(), torch.ones_like(sums))
    return means[inverse], std[inverse], counts[inverse]


def whiten(values: Tensor, mask: Tensor, eps: float) -> Tensor:
    """`values` centred and scaled by the mean and std of its unmasked entries (zero where masked)."""
    valid = values[mask]
    if valid.numel() < 2:
        return values * mask
    return (values - valid.mean()) / (valid.std() + eps) * mask


@register_advantage("grpo")
def grpo(rewards: Tensor, group_index: Tensor, mask: Tensor, *, norm_std: bool, eps: float, **_) -> Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A = (r - mean_group) / (std_group + eps), unbiased std; without
    `norm_std`, r - mean_group. A group of one has mean 0 and std 1."""
    mean, std, size = group_stats(rewards, group_index)
    centred = torch.where(size > 1, rewards - mean, rewards)
    score = centred / (std + eps) if norm_std else centred
    return score[:, None] * mask


@register_advantage("drgrpo")
def drgrpo(rewards: Tensor, group_index: Tensor, mask: Tensor, **_) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A = r - mean_group, no std division."""
    mean, _, size = group_stats(rewards, group_index)
    return torch.where(size > 1, rewards - mean, rewards)[:, None] * mask


@register_advantage("rloo")
def rloo(rewards: Tensor, group_index: Tensor, mask: Tensor, **_) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A = r - the mean of the other responses of the group."""
    mean, _, size = group_stats(rewards, group_index)
    others = torch.where(size > 1, (mean * size - rewards) / (size - 1).clamp(min=1), rewards)
    return (rewards - others)[:, None] * mask


@register_advantage("reinforce_pp")
def reinforce_pp(rewards: Tensor, group_index: Tensor, mask: Tensor, *, gamma: float, eps: float, **_) -> Tensor:
    """REINFORCE++ (Hu 2025): the score on the last response token, returns discounted by `gamma` along the
    response, whitened over the batch's tokens."""
    last = mask.cumsum(1).argmax(1)  # index of the last valid token
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=rewards.device)
    token_rewards[torch.arange(mask.shape[0]), last] = rewards * mask.any(1)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(mask.shape[0], dtype=torch.float32, device=rewards.device)
    for t in reversed(range(mask.shape[1])):
        running = token_rewards[:, t] + gamma * running * mask[:, t]
        returns[:, t] = running
    return whiten(returns * mask, mask, eps)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards: Tensor, group_index: Tensor, mask: Tensor, *, eps: float, **_) -> Tensor:
    """REINFORCE++-baseline (Hu 2025): r - mean_group at every token, whitened over the batch's tokens."""
    mean, _, _ = group_stats(rewards, group_index)
    return whiten((rewards - mean)[:, None] * mask, mask, eps)

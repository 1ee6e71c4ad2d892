"""What PPO with a value model adds: per-token rewards, GAE (Schulman et al. 2016, "High-Dimensional Continuous Control
Using Generalized Advantage Estimation"), and the clipped value loss (as verl's `compute_gae_advantage_return` and
`compute_value_loss`). Per-token tensors are `[N, R]`, aligned with `response_mask`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorarl.trainer.algorithms.aggregation import aggregate, check_shapes
from lorarl.trainer.lazy import torch

if TYPE_CHECKING:
    from torch import Tensor


def last_token_rewards(rewards: Tensor, response_mask: Tensor) -> Tensor:
    """`[N, R]`: each response's score `rewards [N]` on its last valid token, 0 elsewhere (and for an empty one)."""
    mask = response_mask.bool()
    last = mask.cumsum(1).argmax(1)  # index of the last valid token
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=rewards.device)
    token_rewards[torch.arange(mask.shape[0]), last] = rewards.float() * mask.any(1)
    return token_rewards


def gae(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Advantages and returns `[N, R]` by GAE: δ_t = r_t + γ V_{t+1} - V_t, A_t = δ_t + γλ A_{t+1}, returns A + V;
    the value after the last valid token is 0 and masked positions are skipped (their V and δ do not enter the
    recursion). The advantages come back unwhitened (PPO whitens them: `advantages.whiten`)."""
    check_shapes("response_mask", response_mask=response_mask, token_rewards=token_rewards, values=values)
    valid = response_mask.bool()
    rows, length = values.shape
    # Every TD error at once: each position's next valid one (`length`: none, valued 0) is a reversed running min.
    upcoming = torch.where(valid, torch.arange(length, device=values.device), length)
    next_index = torch.cat([upcoming.flip(1).cummin(1).values.flip(1)[:, 1:], upcoming.new_full((rows, 1), length)], 1)
    next_value = torch.cat([values, values.new_zeros(rows, 1)], 1).gather(1, next_index)
    delta = torch.where(valid, token_rewards + gamma * next_value - values, 0.0)
    # Only the accumulation stays a loop, one fused op per position: A = δ + γλ·A on valid tokens, A carried over
    # masked ones (δ 0, factor 1). A loop of a dozen small ops per position cost ~10 ms at 128 tokens on CPU, and on
    # a GPU each op is a kernel launch.
    factor = torch.full_like(values, gamma * lam).masked_fill_(~valid, 1.0)
    running = values.new_zeros(rows)
    columns = []
    for t in reversed(range(length)):
        running = torch.addcmul(delta[:, t], factor[:, t], running)
        columns.append(running)
    advantages = torch.stack(columns[::-1], 1) if columns else torch.zeros_like(values)
    mask = valid.to(values.dtype)
    return advantages * mask, (advantages + values) * mask


def gae_returns(rewards: Tensor, values: Tensor, response_mask: Tensor, *, gamma: float, lam: float,
                token_penalty: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """GAE's advantages (unwhitened) and returns `[N, R]` for one score per response (`rewards [N]`, on its last token)
    minus a per-token penalty (`token_penalty [N, R]`: the KL to the reference, with `kl_in_reward`)."""
    token_rewards = last_token_rewards(rewards, response_mask)
    if token_penalty is not None:
        token_rewards = token_rewards - token_penalty * response_mask
    return gae(token_rewards, values, response_mask, gamma=gamma, lam=lam)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, *, clip: float | None,
               loss_agg_mode: str = "token-mean", **totals: float) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
    """½ · aggregate(max((V - G)², (clip(V, V_old ± clip) - G)²)) and its metrics (`vf_clipfrac`): PPO's clipped value
    loss (`clip` None: unclipped), with the policy loss's aggregation modes."""
    check_shapes("response_mask", response_mask=response_mask, values=values, old_values=old_values, returns=returns)
    unclipped = (values - returns).square()
    if clip is None:
        losses, clipped = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        bounded = old_values + (values - old_values).clamp(-clip, clip)
        clipped_losses = (bounded - returns).square()
        losses, clipped = torch.maximum(unclipped, clipped_losses), clipped_losses > unclipped
    mask = response_mask.bool()
    loss = 0.5 * aggregate(losses, mask, loss_agg_mode, **totals)
    fraction = float((clipped & mask).sum() / mask.sum().clamp(min=1))
    return loss, {"critic/vf_clipfrac": fraction}


def explained_variance(values: Tensor, returns: Tensor, response_mask: Tensor) -> float:
    """1 - Var(G - V) / Var(G) over the valid tokens: 1 when the critic predicts the returns, 0 for a constant."""
    mask = response_mask.bool()
    target, residual = returns[mask].double(), (returns - values)[mask].double()
    if target.numel() < 2 or float(target.var()) == 0.0:
        return 0.0
    return float(1 - residual.var() / target.var())

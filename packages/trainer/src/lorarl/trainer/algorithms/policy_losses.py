"""Policy losses: per-token losses from the current and old log-probs and the advantages, then one aggregation.

Each loss is a function registered under its config name (`algorithm.policy_loss`) returning `(per_token, clipped,
ratio)`: the per-token loss to minimise, where clipping took effect, and the ratio it used (for the metrics).
`policy_loss()` checks the inputs, applies the rollout-correction weights, aggregates (`aggregation.aggregate`) and
measures.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from lorarl.trainer.algorithms.aggregation import aggregate, check_shapes
from lorarl.trainer.registry import Registry

PolicyLoss = Callable[..., tuple[Tensor, Tensor, Tensor]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


def policy_loss(
    name: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    loss_agg_mode: str = "token-mean",
    is_weights: Tensor | None = None,
    **totals: float,
) -> tuple[Tensor, dict[str, float]]:
    """The policy loss (to minimise) and its metrics (`clipfrac`, `approx_kl`, `ratio_mean`).

    `is_weights` (`[N, R]`, from `rollout_is_weights`) multiply the per-token losses before aggregation; `totals`
    are `aggregate`'s denominators.
    """
    fn = POLICY_LOSSES[name]
    check_shapes("response_mask", response_mask=response_mask, logp=logp, old_logp=old_logp, advantages=advantages,
                 is_weights=is_weights)  # fmt: skip
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = response_mask.bool()
    per_token, clipped, ratio = fn(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                   dual_clip=dual_clip)  # fmt: skip
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = aggregate(per_token, mask, loss_agg_mode, **totals)
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        log_ratio = logp - old_logp
        metrics = {
            "clipfrac": float((clipped & mask).sum() / count),
            "approx_kl": float(((-log_ratio).exp() - 1 + log_ratio).mul(mask).sum() / count),
            "ratio_mean": float((ratio * mask).sum() / count),
        }
    return loss, metrics


def clipped_objective(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float, dual_clip: float | None):
    """PPO's pessimistic clipped surrogate per token, `(loss, clipped)`, with dual clip for negative advantages."""
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped_loss)
    if dual_clip is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * dual_clip), per_token)
    return per_token, clipped_loss > unclipped


@register_policy_loss("ppo")
def ppo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float,
        dual_clip: float | None, **_) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """PPO clip (Schulman et al. 2017), with separate low/high clips (DAPO's clip-higher, Yu et al. 2025) and dual
    clip (Ye et al. 2020)."""
    ratio = torch.exp(logp - old_logp)
    return *clipped_objective(ratio, advantages, clip_low, clip_high, dual_clip), ratio


@register_policy_loss("gspo")
def gspo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float,
         dual_clip: float | None, **_) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """GSPO (Zheng et al. 2025): the sequence's length-normalised ratio s_i, clipped. In token form: the value is s_i
    at every token, the gradient s_i · ∇log π(y_t)."""
    lengths = mask.sum(1, keepdim=True).clamp(min=1)
    seq_log_ratio = ((logp - old_logp) * mask).sum(1, keepdim=True) / lengths
    ratio = torch.exp((logp - logp.detach() + seq_log_ratio.detach()).clamp(max=10.0))
    return *clipped_objective(ratio, advantages, clip_low, clip_high, dual_clip), ratio


@register_policy_loss("cispo")
def cispo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_high: float,
          **_) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """CISPO (MiniMax-M1, 2025): the IS weight clipped above at 1 + clip_high and detached, times the log-prob."""
    ratio = torch.exp(logp - old_logp)
    weight = ratio.clamp(max=1 + clip_high).detach()
    return -advantages * weight * logp, ratio.detach() > 1 + clip_high, ratio

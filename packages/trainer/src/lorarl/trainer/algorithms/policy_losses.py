"""Policy losses: per-token losses from the current and old log-probs and the advantages, then one aggregation.

Each loss is a function registered under its config name (`algorithm.policy_loss`), called as
`f(logp, old_logp, advantages, mask, clip, **its settings)` — `clip` the ratio's trust region shared by the PPO family
(`algorithm.clip_low`, `clip_high`, `dual_clip`), its own settings from `algorithm.<name>.*` — and returning
`(per_token, clipped, ratio)`: the per-token loss to minimise, where clipping took effect, and the ratio it used (for
the metrics). `policy_loss()` checks the inputs, applies the rollout-correction weights, aggregates
(`aggregation.aggregate`) and measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lorarl.trainer.algorithms.aggregation import aggregate, check_shapes, checked_output
from lorarl.trainer.lazy import torch
from lorarl.trainer.registry import Plugin, Registry, option

if TYPE_CHECKING:
    from torch import Tensor

POLICY_LOSSES: Registry[Plugin] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


@dataclass(frozen=True)
class ClipRange:
    """The ratio's trust region: [1 - low, 1 + high], and the dual-clip bound for negative advantages (None: off)."""

    low: float = 0.2
    high: float = 0.2
    dual: float | None = None


def policy_loss(
    name: str | Plugin,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip: ClipRange = ClipRange(),
    loss_agg_mode: str = "token-mean",
    is_weights: Tensor | None = None,
    settings: Any = None,
    **totals: float,
) -> tuple[Tensor, dict[str, float]]:
    """The policy loss (to minimise) and its metrics (`clipfrac`, `approx_kl`, `ratio_mean`).

    `is_weights` (`[N, R]`, from `rollout_is_weights`) multiply the per-token losses before aggregation; `settings`
    are the loss's own (its settings dataclass, or a dict of some of them; defaults for the rest); `totals` are
    `aggregate`'s denominators.
    """
    entry = POLICY_LOSSES[name]
    check_shapes("response_mask", response_mask=response_mask, logp=logp, old_logp=old_logp, advantages=advantages,
                 is_weights=is_weights)  # fmt: skip
    if clip.dual is not None and clip.dual <= 1:
        raise ValueError(f"dual_clip must be > 1, got {clip.dual}")
    mask = response_mask.bool()
    returned = entry(logp, old_logp, advantages, mask, clip, **entry.keywords(settings))
    if not isinstance(returned, tuple | list) or len(returned) != 3:
        from lorarl.trainer.errors import TrainerError

        raise TrainerError(f"policy loss {entry.name} ({entry.origin}) returned {type(returned).__name__}; expected "
                           f"(per_token, clipped, ratio), each of shape {tuple(mask.shape)}")  # fmt: skip
    per_token, clipped, ratio = (checked_output(entry, "policy loss", value, mask.shape, what) for value, what in
                                 zip(returned, ("per_token", "clipped", "ratio"), strict=True))  # fmt: skip
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


def clipped_objective(ratio: Tensor, advantages: Tensor, clip: ClipRange):
    """PPO's pessimistic clipped surrogate per token, `(loss, clipped)`, with dual clip for negative advantages."""
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1 - clip.low, 1 + clip.high)
    per_token = torch.maximum(unclipped, clipped_loss)
    if clip.dual is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * clip.dual), per_token)
    return per_token, clipped_loss > unclipped


@register_policy_loss("ppo")
def ppo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip: ClipRange) -> tuple[Tensor, ...]:
    """PPO clip (Schulman et al. 2017), with separate low/high clips (DAPO's clip-higher, Yu et al. 2025) and dual
    clip (Ye et al. 2020)."""
    ratio = torch.exp(logp - old_logp)
    return *clipped_objective(ratio, advantages, clip), ratio


@register_policy_loss("gspo")
def gspo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip: ClipRange) -> tuple[Tensor, ...]:
    """GSPO (Zheng et al. 2025): the sequence's length-normalised ratio s_i, clipped. In token form: the value is s_i
    at every token, the gradient s_i · ∇log π(y_t)."""
    lengths = mask.sum(1, keepdim=True).clamp(min=1)
    seq_log_ratio = ((logp - old_logp) * mask).sum(1, keepdim=True) / lengths
    ratio = torch.exp((logp - logp.detach() + seq_log_ratio.detach()).clamp(max=10.0))
    return *clipped_objective(ratio, advantages, clip), ratio


@register_policy_loss("cispo")
def cispo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip: ClipRange) -> tuple[Tensor, ...]:
    """CISPO (MiniMax-M1, 2025): the IS weight clipped above at 1 + clip_high and detached, times the log-prob."""
    ratio = torch.exp(logp - old_logp)
    weight = ratio.clamp(max=1 + clip.high).detach()
    return -advantages * weight * logp, ratio.detach() > 1 + clip.high, ratio


@register_policy_loss("gpg")
def gpg(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip: ClipRange) -> tuple[Tensor, ...]:
    """GPG (Chu et al. 2025): the plain policy gradient -A·log π, no ratio and no clip (pair it with the `gpg`
    estimator)."""
    return -advantages * logp, torch.zeros_like(mask), torch.exp(logp - old_logp).detach()


def covariance(advantages: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """Per token, (A - mean A)(log π - mean log π) over the valid tokens (detached): the entropy-mechanism paper's
    measure of how much a token drives the entropy down."""
    valid = mask.bool()
    count = valid.sum().clamp(min=1)
    mean_adv = (advantages * valid).sum() / count
    mean_logp = (logp.detach() * valid).sum() / count
    return ((advantages - mean_adv) * (logp.detach() - mean_logp)).detach()


@dataclass
class ClipCovSettings:
    ratio: float = option(2e-4, "share of tokens whose gradient is cut", minimum=0.0)
    lb: float = option(1.0, "lowest covariance cut")
    ub: float = option(5.0, "highest covariance cut")


@register_policy_loss("clip_cov", settings=ClipCovSettings)
def clip_cov(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip: ClipRange, *, ratio: float,
             lb: float, ub: float) -> tuple[Tensor, ...]:  # fmt: skip
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"):
    PPO clip, and a random `ratio` share of the valid tokens whose covariance lies in (`lb`, `ub`) — among those PPO's
    clip left alone — get no gradient at all (reported as clipped)."""
    rho = torch.exp(logp - old_logp)
    per_token, clipped = clipped_objective(rho, advantages, ClipRange(clip.low, clip.high))
    candidates = covariance(advantages, logp, mask)
    candidates = (candidates > lb) & (candidates < ub) & mask.bool() & ~clipped
    chosen = torch.nonzero(candidates)
    keep = max(int(ratio * int(mask.sum())), 1)
    chosen = chosen[torch.randperm(len(chosen), device=chosen.device)[:keep]]
    detached = torch.zeros_like(mask, dtype=torch.bool)
    detached[chosen[:, 0], chosen[:, 1]] = True
    return torch.where(detached, 0.0, per_token), clipped | detached, rho


@dataclass
class KlCovSettings:
    ratio: float = option(2e-4, "share of tokens with the KL penalty", minimum=0.0)
    coef: float = option(1.0, "weight of its |log ratio| penalty")


@register_policy_loss("kl_cov", settings=KlCovSettings)
def kl_cov(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip: ClipRange, *, ratio: float,
           coef: float) -> tuple[Tensor, ...]:  # fmt: skip
    """KL-Cov (Cui et al. 2025, as Clip-Cov): the unclipped -A·ρ, plus `coef`·|log ρ| on the `ratio` share of valid
    tokens with the largest covariance (their updates are held close to the old policy)."""
    log_ratio = logp - old_logp
    rho = torch.exp(log_ratio)
    per_token = -advantages * rho
    scores = torch.where(mask.bool(), covariance(advantages, logp, mask), -torch.inf).flatten()
    top = scores.topk(max(1, int(int(mask.sum()) * ratio))).indices
    penalised = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    penalised[top] = True
    penalised = penalised.view_as(mask) & mask.bool()
    return torch.where(penalised, per_token + coef * log_ratio.abs(), per_token), penalised, rho


@register_policy_loss("gmpo")
def gmpo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip: ClipRange) -> tuple[Tensor, ...]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"): the sequence's geometric mean of token ratios,
    each token's log ratio clipped to [-clip_low, clip_high] (in log space, on the side that matters for the sign
    of A), times the sequence's mean advantage; the same value at every token, so `seq-mean-token-mean` (the `gmpo`
    preset) gives the paper's mean over sequences."""
    log_ratio = logp - old_logp
    valid = mask.to(logp.dtype)
    sign = torch.sign(advantages)
    bounded = log_ratio.clamp(-clip.low, clip.high)
    log_ratio_clipped = sign * torch.minimum(sign * log_ratio, sign * bounded)
    lengths = valid.sum(1, keepdim=True).clamp(min=1)
    ratio = torch.exp((log_ratio_clipped * valid).sum(1, keepdim=True) / lengths)
    advantage = (advantages * valid).sum(1, keepdim=True) / lengths
    per_token = (-advantage * ratio).expand_as(logp)
    return per_token, log_ratio != bounded, ratio.expand_as(logp)


@dataclass
class SapoSettings:
    tau_pos: float = option(1.0, "gate temperature for positive advantages", minimum=1e-6)
    tau_neg: float = option(1.05, "gate temperature for negative advantages", minimum=1e-6)


@register_policy_loss("sapo", settings=SapoSettings)
def sapo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip: ClipRange, *, tau_pos: float,
         tau_neg: float) -> tuple[Tensor, ...]:  # fmt: skip
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): a smooth gate instead of the
    hard clip, -A · σ(τ(ρ - 1))·4/τ, with τ = `tau_pos` for A > 0 and `tau_neg` for A < 0: its gradient is ρ's at
    ρ = 1 and fades smoothly away from it. Nothing is clipped."""
    ratio = torch.exp(logp - old_logp)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -advantages * gate, torch.zeros_like(mask, dtype=torch.bool), ratio

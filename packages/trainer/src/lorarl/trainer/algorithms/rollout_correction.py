"""Rollout correction (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):
samples drawn by the engine (π_rollout) are trained as if drawn by the trainer's policy (π_old); truncated importance
weights correct for the difference, and the mismatch is measured."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorarl.trainer.algorithms.aggregation import check_shapes
from lorarl.trainer.lazy import torch

if TYPE_CHECKING:
    from torch import Tensor

IS_LEVELS = ("token", "sequence", "token_mask", "sequence_reject")
CORRECTIONS = ("none", *IS_LEVELS)  # algorithm.rollout_correction's values


def rollout_is_weights(old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, level: str, cap: float,
                       band: tuple[float, float] = (0.5, 2.0)) -> Tensor:  # fmt: skip
    """Correction weights `[N, R]` (detached, zero on masked tokens) for the per-token losses, with ρ_t =
    π_old(y_t) / π_rollout(y_t):

    - token: truncated importance weights w_t = min(ρ_t, cap) (verl's rollout_is, truncate mode);
    - sequence: w = min(Π_t ρ_t, cap) at every token of the sequence;
    - token_mask: w_t = 1 where `band[0]` <= ρ_t <= `band[1]`, else 0 — tokens the two sides disagree on too much
      get no gradient (IcePop, Ling Team 2025, "Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model");
    - sequence_reject: w = 1 for a sequence whose Π_t ρ_t lies in `band`, else 0 at all its tokens (rejection
      sampling at the sequence level, verl's rollout_rs).

    Log-ratios are clamped to ±20 before exp, as verl does.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {IS_LEVELS}, got {level!r}")
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if not 0 <= band[0] <= 1 <= band[1]:
        raise ValueError(f"band must be [low, high] with 0 <= low <= 1 <= high, got {list(band)}")
    check_shapes("response_mask", response_mask=response_mask, old_logp=old_logp, rollout_logp=rollout_logp)
    mask = response_mask.to(old_logp.dtype)
    log_ratio = (old_logp - rollout_logp).detach() * mask
    if level in ("sequence", "sequence_reject"):
        log_ratio = log_ratio.sum(1, keepdim=True).expand_as(log_ratio)
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    if level in ("token_mask", "sequence_reject"):
        return ((ratio >= band[0]) & (ratio <= band[1])).to(mask.dtype) * mask
    return ratio.clamp(max=cap) * mask


def rollout_mismatch(old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor) -> dict[str, float]:
    """How far the engine's sampling distribution is from the trainer's, on the valid tokens: mean |Δ log p|, the
    k3 estimate of KL(π_rollout || π_old), and quantiles of the token ratio π_old / π_rollout."""
    check_shapes("response_mask", response_mask=response_mask, old_logp=old_logp, rollout_logp=rollout_logp)
    mask = response_mask.bool()
    delta = (old_logp - rollout_logp).detach()[mask].double()
    if delta.numel() == 0:
        return {}
    ratio = delta.exp()
    quantiles = torch.quantile(ratio, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
    return {
        "rollout/abs_logp_diff": float(delta.abs().mean()),
        "rollout/kl": float((ratio - 1 - delta).mean()),
        "rollout/ratio_p05": float(quantiles[0]),
        "rollout/ratio_p50": float(quantiles[1]),
        "rollout/ratio_p95": float(quantiles[2]),
        "rollout/ratio_max": float(ratio.max()),
    }

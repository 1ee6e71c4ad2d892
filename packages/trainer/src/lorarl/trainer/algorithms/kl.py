"""KL estimators (Schulman 2020, "Approximating KL divergence"): per-token estimates of KL(π || π_ref) from the
log-probs of the sampled tokens, registered under their config names (`algorithm.kl_estimator`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lorarl.trainer.algorithms.aggregation import checked_output
from lorarl.trainer.lazy import torch
from lorarl.trainer.registry import Plugin, Registry

if TYPE_CHECKING:
    from torch import Tensor

KL_ESTIMATORS: Registry[Plugin] = Registry("KL estimator")
register_kl_estimator = KL_ESTIMATORS.register


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str | Plugin, settings=None) -> Tensor:
    """Per-token estimate of KL(π || π_ref) by the estimator registered as `kind` (with its `settings`, if it has
    any)."""
    entry = KL_ESTIMATORS[kind]
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp must have the shape of logp {tuple(logp.shape)}, got {tuple(ref_logp.shape)}")
    return checked_output(
        entry, "KL estimator", entry(logp - ref_logp, **entry.keywords(settings)), logp.shape, "the per-token KL"
    )


@register_kl_estimator("k1")
def k1(log_ratio: Tensor) -> Tensor:
    """log π/π_ref: unbiased, high variance."""
    return log_ratio


@register_kl_estimator("k2")
def k2(log_ratio: Tensor) -> Tensor:
    """½ (log π/π_ref)²: biased, low variance."""
    return 0.5 * log_ratio.square()


@register_kl_estimator("k3")
def k3(log_ratio: Tensor) -> Tensor:
    """π_ref/π - 1 - log π_ref/π: unbiased, low variance, non-negative; clamped as verl does (the exponent to ±20,
    so that it cannot overflow, the value to [-10, 10])."""
    reverse = (-log_ratio).clamp(-20, 20)
    return (torch.exp(reverse) - reverse - 1).clamp(-10, 10)


@register_kl_estimator("abs")
def absolute(log_ratio: Tensor) -> Tensor:
    """|log π/π_ref|."""
    return log_ratio.abs()


register_kl_estimator("low_var_kl")(k3)  # verl's name for k3
register_kl_estimator("mse")(k2)  # and for k2


def with_k2_gradient(estimator: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """`estimator`'s value with k2's gradient (straight through). k1 and k3 are unbiased estimates of the KL, but their
    expected gradients are not the KL's gradient; k2's is (verl's "k1+", "k3+")."""

    def straight_through(log_ratio: Tensor) -> Tensor:
        gradient = k2(log_ratio)
        return gradient - gradient.detach() + estimator(log_ratio).detach()

    straight_through.__doc__ = f"{estimator.__name__}'s value, k2's gradient."
    return straight_through


register_kl_estimator("k1+")(with_k2_gradient(k1))
register_kl_estimator("k3+")(with_k2_gradient(k3))

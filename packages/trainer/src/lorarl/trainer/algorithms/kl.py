"""KL estimators (Schulman 2020, "Approximating KL divergence"): per-token estimates of KL(π || π_ref) from the
log-probs of the sampled tokens, registered under their config names (`algorithm.kl_estimator`)."""

from collections.abc import Callable

import torch
from torch import Tensor

from lorarl.trainer.registry import Registry

KL_ESTIMATORS: Registry[Callable[[Tensor], Tensor]] = Registry("KL estimator")
register_kl_estimator = KL_ESTIMATORS.register


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(π || π_ref) by the estimator registered as `kind`."""
    fn = KL_ESTIMATORS[kind]
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp must have the shape of logp {tuple(logp.shape)}, got {tuple(ref_logp.shape)}")
    return fn(logp - ref_logp)


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
    """π_ref/π - 1 - log π_ref/π: unbiased, low variance, non-negative; clamped to [-10, 10] as verl does."""
    return (torch.exp(-log_ratio) + log_ratio - 1).clamp(-10, 10)


register_kl_estimator("low_var_kl")(k3)  # verl's name for k3

"""The GRPO family's building blocks: advantage estimators, policy losses, loss aggregation, KL estimators.

Semantics follow the papers and verl's implementations, so that results transfer:
- GRPO (Shao et al. 2024, DeepSeekMath): A = (r - mean_group) / (std_group + eps), unbiased std.
- Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A = r - mean_group; "seq-mean-token-sum-norm".
- RLOO (Ahmadian et al. 2024): A = r - mean of the other responses of the group.
- REINFORCE++ (Hu 2025): the score on the last token, discounted returns, whitened over the batch's tokens.
- PPO clip (Schulman et al. 2017) with separate low/high clips (DAPO's clip-higher, Yu et al. 2025) and dual clip
  (Ye et al. 2020); GSPO (Zheng et al. 2025): a sequence-level ratio; CISPO (MiniMax-M1, 2025): clipped IS weight
  times log-prob, detached.
- KL estimators k1, k2, k3 (Schulman 2020, "Approximating KL divergence"); k3 = verl's "low_var_kl", clamped to
  [-10, 10].
- DAPO (Yu et al. 2025): dynamic sampling keeps only groups whose rewards differ; soft overlong punishment.
- Rollout correction (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):
  truncated importance weights min(π_old / π_rollout, cap), per token or per sequence, as verl's rollout_is.
All per-token tensors are `[N, R]`, aligned with `response_mask` (1 for response tokens, 0 for padding).
"""

import torch
from torch import Tensor

ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
IS_LEVELS = ("token", "sequence")


def _check_shapes(reference: str, **tensors: Tensor | None) -> None:
    """Per-token inputs must all have the shape of `reference` (the first one named): `[N, R]`."""
    shape = tuple(tensors[reference].shape)
    if len(shape) != 2:
        raise ValueError(f"{reference} must be [N, R], got shape {shape}")
    for name, tensor in tensors.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have the shape of {reference} {shape} ([N, R]), got {tuple(tensor.shape)}")


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sample: its group's mean, unbiased std, and size."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    groups = counts.numel()
    sums = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    means = sums / counts
    squares = torch.zeros_like(sums).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
    std = torch.where(counts > 1, (squares / (counts - 1).clamp(min=1)).sqrt(), torch.ones_like(sums))
    return means[inverse], std[inverse], counts[inverse]


def _whiten(values: Tensor, mask: Tensor, eps: float) -> Tensor:
    valid = values[mask]
    if valid.numel() < 2:
        return values * mask
    return (values - valid.mean()) / (valid.std() + eps) * mask


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
    """Per-token advantages `[N, R]` (zero on masked tokens) from one score per response (`rewards [N]`)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    mask = response_mask.bool()
    if rewards.dim() != 1 or group_index.shape != rewards.shape or mask.dim() != 2 or mask.shape[0] != rewards.numel():
        raise ValueError(
            f"expected rewards [N], group_index [N], response_mask [N, R]; got {tuple(rewards.shape)}, "
            f"{tuple(group_index.shape)}, {tuple(response_mask.shape)}"
        )
    rewards = rewards.to(torch.float32)
    mean, std, size = _group_stats(rewards, group_index)
    if estimator in ("grpo", "drgrpo"):
        centred = torch.where(size > 1, rewards - mean, rewards)  # a group of one: mean 0 (and std 1)
        score = centred / (std + eps) if (estimator == "grpo" and norm_std) else centred
        return score[:, None] * mask
    if estimator == "rloo":
        others = torch.where(size > 1, (mean * size - rewards) / (size - 1).clamp(min=1), rewards)
        return (rewards - others)[:, None] * mask
    if estimator == "reinforce_pp_baseline":
        return _whiten((rewards - mean)[:, None] * mask, mask, eps)
    # reinforce_pp: the score on the last response token, discounted returns along the response
    last = mask.cumsum(1).argmax(1)  # index of the last valid token
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=rewards.device)
    token_rewards[torch.arange(mask.shape[0]), last] = rewards * mask.any(1)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(mask.shape[0], dtype=torch.float32, device=rewards.device)
    for t in reversed(range(mask.shape[1])):
        running = token_rewards[:, t] + gamma * running * mask[:, t]
        returns[:, t] = running
    return _whiten(returns * mask, mask, eps)


def aggregate(
    values: Tensor,
    response_mask: Tensor,
    mode: str,
    *,
    norm_len: int | None = None,
    total_tokens: float | None = None,
    total_sequences: float | None = None,
) -> Tensor:
    """One scalar from per-token values `[N, R]`.

    token-mean: Σ over valid tokens / their count. seq-mean-token-sum: per-sequence sums, averaged over sequences.
    seq-mean-token-mean: per-sequence means, averaged. seq-mean-token-sum-norm: per-sequence sums / `norm_len`
    (default R), averaged (Dr. GRPO). `total_tokens` / `total_sequences` replace this batch's counts as the
    denominators, so that the sum over micro-batches equals the value of the whole batch.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode must be one of {AGG_MODES}, got {mode!r}")
    _check_shapes("response_mask", response_mask=response_mask, values=values)
    mask = response_mask.to(values.dtype)
    masked = values * mask
    sequences = total_sequences if total_sequences is not None else float(values.shape[0])
    if mode == "token-mean":
        tokens = total_tokens if total_tokens is not None else mask.sum().clamp(min=1)
        return masked.sum() / tokens
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(sequences, 1)
    if mode == "seq-mean-token-mean":
        per_sequence = masked.sum(1) / mask.sum(1).clamp(min=1)
        return per_sequence.sum() / max(sequences, 1)
    return masked.sum() / (norm_len if norm_len is not None else values.shape[1]) / max(sequences, 1)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(π || π_ref) from log-probs of the sampled tokens."""
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp must have the shape of logp {tuple(logp.shape)}, got {tuple(ref_logp.shape)}")
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    return (torch.exp(-log_ratio) + log_ratio - 1).clamp(-10, 10)  # k3 = low_var_kl


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
    """The policy loss (to minimise) and its metrics (`clipfrac`, `approx_kl`, ...).

    `is_weights` (`[N, R]`, from `rollout_is_weights`) multiply the per-token losses before aggregation.
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss must be one of {POLICY_LOSSES}, got {name!r}")
    _check_shapes("response_mask", response_mask=response_mask, logp=logp, old_logp=old_logp,
                  advantages=advantages, is_weights=is_weights)  # fmt: skip
    mask = response_mask.bool()
    log_ratio = logp - old_logp
    if name == "gspo":
        lengths = mask.sum(1, keepdim=True).clamp(min=1)
        seq_log_ratio = (log_ratio * mask).sum(1, keepdim=True) / lengths
        # GSPO's token form: the value is the sequence ratio s_i at every token, the gradient s_i · ∇log π(y_t)
        log_ratio = (logp - logp.detach() + seq_log_ratio.detach()).clamp(max=10.0)
    ratio = torch.exp(log_ratio)
    if name == "cispo":
        weight = ratio.clamp(max=1 + clip_high).detach()
        per_token = -advantages * weight * logp
        clipped = ratio.detach() > 1 + clip_high
    else:
        unclipped = -advantages * ratio
        clipped_loss = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
        per_token = torch.maximum(unclipped, clipped_loss)
        clipped = clipped_loss > unclipped
        if dual_clip is not None:
            if dual_clip <= 1:
                raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
            capped = torch.minimum(per_token, -advantages * dual_clip)
            per_token = torch.where(advantages < 0, capped, per_token)
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = aggregate(per_token, mask, loss_agg_mode, **totals)
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        metrics = {
            "clipfrac": float((clipped & mask).sum() / count),
            "approx_kl": float(((-(logp - old_logp)).exp() - 1 + (logp - old_logp)).mul(mask).sum() / count),
            "ratio_mean": float((ratio * mask).sum() / count),
        }
    return loss, metrics


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to `max_tokens - buffer` tokens, then falling
    linearly to `-penalty` at `max_tokens` (verl: min(-(len - (max - buffer)) / buffer * penalty, 0))."""
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"buffer must be in [1, max_tokens={max_tokens}], got {buffer}")
    exceed = lengths.to(torch.float32) - (max_tokens - buffer)
    return (-exceed / buffer * penalty).clamp(max=0.0)


def informative_groups(rewards: Tensor, group_index: Tensor) -> Tensor:
    """`[N]` bool: the samples of groups whose rewards are not all equal (DAPO's dynamic-sampling filter). A group
    whose rewards agree has zero advantage under any group baseline, so it only dilutes the batch's gradient. Groups
    of one are kept (nothing to compare; as verl)."""
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"expected rewards [N] and group_index [N], got {tuple(rewards.shape)}, "
                         f"{tuple(group_index.shape)}")  # fmt: skip
    rewards = rewards.to(torch.float64)
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    groups = counts.numel()
    low = torch.full((groups,), torch.inf, dtype=rewards.dtype).scatter_reduce(0, inverse, rewards, "amin")
    high = torch.full((groups,), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, inverse, rewards, "amax")
    return ((high > low) | (counts == 1))[inverse]


def rollout_is_weights(old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, level: str, cap: float) -> Tensor:
    """Truncated importance weights `[N, R]` (detached, zero on masked tokens) for samples drawn by the rollout
    engine (π_rollout) but trained as if drawn by the trainer's policy (π_old).

    token: w_t = min(π_old(y_t) / π_rollout(y_t), cap). sequence: w = min(Π_t π_old(y_t) / π_rollout(y_t), cap) at
    every token of the sequence. Log-ratios are clamped to ±20 before exp, as verl does.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {IS_LEVELS}, got {level!r}")
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    _check_shapes("response_mask", response_mask=response_mask, old_logp=old_logp, rollout_logp=rollout_logp)
    mask = response_mask.to(old_logp.dtype)
    log_ratio = (old_logp - rollout_logp).detach() * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(1, keepdim=True).expand_as(log_ratio)
    return torch.exp(log_ratio.clamp(-20.0, 20.0)).clamp(max=cap) * mask


def rollout_mismatch(old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor) -> dict[str, float]:
    """How far the engine's sampling distribution is from the trainer's, on the valid tokens: mean |Δ log p|, the
    k3 estimate of KL(π_rollout || π_old), and quantiles of the token ratio π_old / π_rollout."""
    _check_shapes("response_mask", response_mask=response_mask, old_logp=old_logp, rollout_logp=rollout_logp)
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

"""The RL algorithms' building blocks, each kind in a registry that config choices and `--help` read.

- `advantages`: estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++ ...), `@register_advantage(name)`;
- `policy_losses`: PPO clip, GSPO, CISPO ..., `@register_policy_loss(name)`, aggregated by `aggregation.aggregate`;
- `kl`: KL estimators, `@register_kl_estimator(name)`;
- `rollout_correction`: importance weights against the engine's sampling mismatch;
- `dapo`: dynamic sampling's filter and the overlong penalty;
- `critic`: what PPO with a value model adds — GAE, the clipped value loss, explained variance.

All per-token tensors are `[N, R]`, aligned with `response_mask` (1 for response tokens, 0 for padding). Semantics
follow the papers and verl's `core_algos`, so that results transfer.
"""

from lorarl.trainer.algorithms.advantages import ADVANTAGES, AdvantageEstimator, advantages, register_advantage
from lorarl.trainer.algorithms.aggregation import AGG_MODES, aggregate
from lorarl.trainer.algorithms.critic import explained_variance, gae_returns, value_loss
from lorarl.trainer.algorithms.dapo import informative_groups, overlong_buffer, overlong_penalty
from lorarl.trainer.algorithms.kl import KL_ESTIMATORS, kl_penalty, register_kl_estimator
from lorarl.trainer.algorithms.policy_losses import POLICY_LOSSES, ClipRange, policy_loss, register_policy_loss
from lorarl.trainer.algorithms.rollout_correction import IS_LEVELS, rollout_is_weights, rollout_mismatch

__all__ = [
    "ADVANTAGES", "AGG_MODES", "IS_LEVELS", "KL_ESTIMATORS", "POLICY_LOSSES", "AdvantageEstimator", "ClipRange",
    "advantages", "aggregate", "explained_variance", "gae_returns", "informative_groups", "kl_penalty",
    "overlong_buffer", "overlong_penalty", "policy_loss", "register_advantage", "register_kl_estimator",
    "register_policy_loss", "rollout_is_weights", "rollout_mismatch", "value_loss",
]  # fmt: skip

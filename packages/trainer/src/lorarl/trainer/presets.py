"""Ready-made algorithm settings, selected with `algorithm=<name>` (each overrides the `algorithm` section)."""

PRESETS: dict[str, dict] = {
    "grpo": {"adv_estimator": "grpo", "norm_std": True, "policy_loss": "ppo", "loss_agg_mode": "token-mean"},
}

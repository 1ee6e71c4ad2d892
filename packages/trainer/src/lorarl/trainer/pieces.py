"""The keys that choose a pluggable piece, and the registry each chooses from: what the configuration reads to derive
the schema (each piece's settings under its name) and to check a config. Imports no torch."""


def pluggable() -> dict:
    """Each key that chooses a pluggable piece, and the registry it chooses from (the piece's settings live in the
    key's section, under the piece's name)."""
    from lorarl.trainer.algorithms import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES
    from lorarl.trainer.engines import ENGINES
    from lorarl.trainer.envs import ENVIRONMENTS
    from lorarl.trainer.rewards import REWARDS
    from lorarl.trainer.sync_kinds import SYNC_KINDS

    return {"algorithm.adv_estimator": ADVANTAGES, "algorithm.policy_loss": POLICY_LOSSES,
            "algorithm.kl_estimator": KL_ESTIMATORS, "rollout.engine": ENGINES, "rollout.sync": SYNC_KINDS,
            "reward.fn": REWARDS, "reward.fns": REWARDS, "env.name": ENVIRONMENTS}  # fmt: skip

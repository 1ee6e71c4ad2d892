"""Validation: greedy answers to the held-out prompts, scored by the run's reward."""

import numpy as np

from lorarl.trainer import data, rewards
from lorarl.trainer.engines import RolloutEngine
from lorarl.trainer.rollout import greedy_scores


def evaluate(engine: RolloutEngine, examples: list[data.Example], tokenizer, reward: rewards.Rewards, *,
             max_tokens: int, version: int) -> dict:  # fmt: skip
    """Mean reward, and accuracy (the share with full reward, >= 1), of the engine's greedy answers from weights
    `version`."""
    scores = greedy_scores(engine, examples, tokenizer, reward, max_tokens=max_tokens, version=version)
    return {"val/reward": float(np.mean(scores)), "val/accuracy": float(np.mean([s >= 1.0 for s in scores]))}

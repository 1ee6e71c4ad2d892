"""Validation: greedy answers to the held-out prompts, scored by the run's reward."""

from collections.abc import Callable

import numpy as np

from lorarl.trainer import data, rewards
from lorarl.trainer.engines import RolloutEngine
from lorarl.trainer.rollout import check_versions


def evaluate(engine: RolloutEngine, examples: list[data.Example], tokenizer, reward_fn: Callable, *, max_tokens: int,
             version: int) -> dict:  # fmt: skip
    """Mean reward, and accuracy (the share with full reward, >= 1), of the engine's greedy answers from weights
    `version`."""
    completions = engine.generate([e.prompt_ids for e in examples], n=1, temperature=0.0, top_p=1.0,
                                  max_tokens=max_tokens, seed=0)  # fmt: skip
    check_versions(completions, version)
    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    scores = rewards.score(reward_fn, [e.prompt for e in examples], texts, [e.answer for e in examples])
    return {"val/reward": float(np.mean(scores)), "val/accuracy": float(np.mean([s >= 1.0 for s in scores]))}

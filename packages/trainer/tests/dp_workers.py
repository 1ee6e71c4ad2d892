"""Ranks of the data-parallel test: one training step of the real Trainer on a fixed batch (no engine)."""

import os
import random

from trainer_fixtures import tiny_overrides
from transformers.modeling_layers import GradientCheckpointingLayer

from lorarl.trainer.config import load_config
from lorarl.trainer.engines import Completion
from lorarl.trainer.loop import Trainer
from lorarl.trainer.parallel import full_state_dict
from lorarl.trainer.presets import PRESETS
from lorarl.trainer.recompute import is_checkpointed
from lorarl.trainer.rollout import Rollouts, Sample


def fixed_samples(groups: int = 6, n: int = 4) -> list[Sample]:
    """Prompts and responses of varied lengths over the tiny vocabulary, rewards with ties."""
    rng = random.Random(0)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(2, 16) for _ in range(rng.randrange(2, 9))]
        for _ in range(n):
            response = tuple(rng.randrange(2, 16) for _ in range(rng.randrange(1, 7)))
            completion = Completion(g, response, tuple(-1.0 for _ in response), True, 0)
            reward = float(rng.randrange(0, 3))
            samples.append(Sample(prompt, completion, g, reward, reward))
    return samples


def one_step(port: int, rank: int, world: int, setup: dict, output_dir: str, extra: dict) -> dict:
    if world > 1:  # (a world of one is the plain trainer, the reference: torchrun's variables would shard it)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))  # fmt: skip
    trainer = Trainer(load_config(None, tiny_overrides(setup, output_dir, **extra), presets=PRESETS))
    assert (trainer.dp is None) == (world == 1)
    # no engine here: rollouts (scripted below) and, on the main rank too, a weight sync without one
    trainer.rollouts = Rollouts(trainer.config, None, trainer.train_set, trainer.sampler, trainer.tokenizer,
                                trainer.reward)  # fmt: skip
    trainer.weights = trainer.weights or trainer._weight_sync(None)
    trainer.rollouts.collect = lambda step, version: (fixed_samples(), {})  # the same batch whatever the world size
    metrics = trainer.train_step(1)
    trainable = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    if trainer.critic is not None:  # its adapter is among the model's; its value head is beside it
        trainable.update({f"value_head.{name}": p for name, p in trainer.critic.head.named_parameters()})
        trainer.save(1)  # gathers the critic's weights and optimizer state: a collective of every rank
    weights = {name: t.numpy() for name, t in full_state_dict(trainable).items()}
    keys = ("loss", "kl", "entropy", "grad_norm", "clipfrac", "approx_kl")
    keys += tuple(k for k in metrics if k.startswith("critic/"))
    layers = [m for m in trainer.model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return {"weights": weights, "metrics": {k: metrics[k] for k in keys},
            "checkpointed": bool(layers) and all(map(is_checkpointed, layers))}  # fmt: skip

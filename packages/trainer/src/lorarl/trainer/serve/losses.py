"""The Tinker API's loss functions, on one datum's per-token log-probs: each returns the per-token loss, which the
server sums over tokens and data (the API's reduction: a sum, never a mean — the client scales by its weights or
advantages).

With `ratio = exp(logp - sampling_logprobs)` (the datum's `logprobs` are the sampler's):
- `cross_entropy`: `-weights · logp`
- `importance_sampling`: `-ratio · advantages` (the REINFORCE gradient, corrected for a stale sampler)
- `ppo`: `-min(ratio · A, clip(ratio, low, high) · A)`
- `cispo`: `-sg(clip(ratio, low, high)) · logp · A` (the clipped ratio weighs the log-prob's gradient, never cuts it)
`low` and `high` are `loss_fn_config`'s `clip_low_threshold` and `clip_high_threshold` (0.8 and 1.2 unless given).
"""

from collections.abc import Callable

import torch
from torch import Tensor

CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def cross_entropy(logp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    return -inputs["weights"] * logp


def importance_sampling(logp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    return -torch.exp(logp - inputs["logprobs"]) * inputs["advantages"]


def ppo(logp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    ratio, advantages = torch.exp(logp - inputs["logprobs"]), inputs["advantages"]
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages)


def cispo(logp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    ratio = torch.exp(logp - inputs["logprobs"]).detach()
    weight = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -weight * logp * inputs["advantages"]


LossFn = Callable[[Tensor, dict[str, Tensor], dict[str, float]], Tensor]
# name -> (function, the float inputs it reads beside `target_tokens`, the config keys it takes with their defaults)
LOSSES: dict[str, tuple[LossFn, tuple[str, ...], dict[str, float]]] = {
    "cross_entropy": (cross_entropy, ("weights",), {}),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages"), {}),
    "ppo": (ppo, ("logprobs", "advantages"), CLIP_DEFAULTS),
    "cispo": (cispo, ("logprobs", "advantages"), CLIP_DEFAULTS),
}

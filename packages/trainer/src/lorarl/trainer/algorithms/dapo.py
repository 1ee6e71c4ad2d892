"""DAPO's (Yu et al. 2025) changes to what the policy trains on: dynamic sampling keeps only groups whose rewards
differ; a soft overlong punishment lowers the reward of responses near the length limit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorarl.trainer.algorithms.advantages import group_stats
from lorarl.trainer.lazy import torch

if TYPE_CHECKING:
    from torch import Tensor


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """The soft overlong punishment, added to the reward: 0 up to `max_tokens - buffer` tokens, then falling
    linearly to `-penalty` at `max_tokens` (verl: min(-(len - (max - buffer)) / buffer * penalty, 0))."""
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"buffer must be in [1, max_tokens={max_tokens}], got {buffer}")
    exceed = lengths.to(torch.float32) - (max_tokens - buffer)
    return (-exceed / buffer * penalty).clamp(max=0.0)


def informative_groups(rewards: Tensor, group_index: Tensor) -> Tensor:
    """`[N]` bool: the samples of groups whose rewards are not all equal (dynamic sampling's filter). A group whose
    rewards agree has zero advantage under any group baseline, so it only dilutes the batch's gradient. Groups of
    one are kept (nothing to compare; as verl)."""
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"expected rewards [N] and group_index [N], got {tuple(rewards.shape)}, "
                         f"{tuple(group_index.shape)}")  # fmt: skip
    stats = group_stats(rewards, group_index)
    return ~stats.tied | (stats.size == 1)


def overlong_buffer(fraction: float, max_tokens: int) -> int:
    """The overlong penalty's ramp in tokens: `fraction` of `max_tokens`, at least one."""
    return max(1, round(fraction * max_tokens))

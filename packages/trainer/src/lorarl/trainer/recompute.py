"""Gradient checkpointing of the decoder layers (`actor.gradient_checkpointing`), with the shared prompts kept.

A checkpointed layer keeps its inputs, not its activations, and runs again in the backward. transformers' own
checkpointing drops a KV cache passed to a layer (a replay would append to it a second time), which would cost the
padded layout its shared prompts: each distinct prompt runs once and its cache serves all its responses
(`logprobs`). So the layers are wrapped here instead, and what a replay may see is decided by the cache:
- no cache: checkpointed;
- a cache the layer writes (the prompts' forward, which fills it): not checkpointed — it holds the distinct prompts
  only, 1/n of the prompt tokens of the micro-batch;
- a read-only prefix (`read_only_prefix`: the responses' forward): checkpointed — each call returns the prompt's
  keys and values followed by the new ones without storing them, so the replay computes what the forward did.
A mixture's routing plan (`routing`) is kept with the layer's inputs: its recompute routes as its forward did.
"""

from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lorarl.trainer import routing
from lorarl.trainer.errors import TrainerError

_READ_ONLY = "lorarl_read_only_prefix"  # marks a cache made by read_only_prefix
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")  # a layer's cache, by its names in transformers


def checkpoint_layers(model: nn.Module) -> None:
    """Checkpoints every decoder layer of `model` (a transformers model, maybe inside peft) in forwards with
    gradients. Non-reentrant: the frozen base's inputs need no gradient, and it nests with `cpu_attention`'s own
    recompute and FSDP's gathers."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise TrainerError(f"actor.gradient_checkpointing=true: {type(model).__name__} has no decoder layers "
                           "transformers can checkpoint")  # fmt: skip
    for layer in layers:
        layer.forward = partial(_checkpointed, layer.forward)


def is_checkpointed(layer: nn.Module) -> bool:
    """Whether `checkpoint_layers` has wrapped this layer."""
    return isinstance(layer.forward, partial) and layer.forward.func is _checkpointed


def _checkpointed(forward, *args, **kwargs):
    writes_a_cache = any(kwargs.get(name) is not None and not getattr(kwargs[name], _READ_ONLY, False)
                         for name in _CACHE_ARGUMENTS)  # fmt: skip
    if not torch.is_grad_enabled() or writes_a_cache:
        return forward(*args, **kwargs)
    plan = routing.current()  # the replay in the backward routes as this forward does
    if plan is not None:
        forward = partial(routing.under, plan, forward)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def read_only_prefix(cache) -> None:
    """Turns a transformers KV cache into a fixed prefix: each layer's update returns its keys and values followed by
    the new ones, and stores nothing (the forward that reads it may be replayed; nothing reads the cache after it)."""
    for layer in cache.layers:
        layer.update = partial(_after_prefix, layer.keys, layer.values)
    setattr(cache, _READ_ONLY, True)


def _after_prefix(keys: Tensor, values: Tensor, key_states: Tensor, value_states: Tensor, *_, **__):
    return torch.cat([keys, key_states], -2), torch.cat([values, value_states], -2)

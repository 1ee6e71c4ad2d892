"""SDPA for 16-bit models on a CPU: training forwards and decode steps attend in fp32.

torch's CPU flash-attention kernel is several times slower in bf16 than with q, k and v cast to fp32 first:
- where gradients flow (the training forwards): the fp32 attention is recomputed in the backward from the 16-bit
  inputs autograd keeps, so fp32 copies of q, k and v never stay in memory;
- in a decode step (one query token, many sequences, grouped KV heads). transformers also repeats the KV cache per
  query head before SDPA when a mask is given, a copy of the whole cache each step; here the KV heads are shared
  inside SDPA (`enable_gqa`).
Other forwards without gradients (prefills, reference log-probs) keep transformers' SDPA, as fast there. Results are
cast back to the model's dtype: the model sees the same dtypes, only more exact attention.
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

NAME = "lorarl_cpu_sdpa"
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def cpu_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' SDPA attention, on fp32 copies of q, k and v when gradients flow through 16-bit ones (LoRA on
    any of the projections) or in a decode step."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    sixteen_bit = dtype in SIXTEEN_BIT
    if sixteen_bit and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            output, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), attention_mask, **kwargs)
            return output.to(dtype)

        # recomputed in the backward: autograd keeps the 16-bit inputs, not fp32 copies (2x their bytes; with GQA
        # repeated per head)
        return checkpoint(attention, query, key, value, use_reentrant=False), None
    decode_step = query.shape[2] == 1 and kwargs.get("position_bias") is None and not kwargs.get("dropout")
    if sixteen_bit and decode_step:
        output = torch.nn.functional.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), attn_mask=attention_mask, scale=kwargs.get("scaling"),
            enable_gqa=query.shape[1] != key.shape[1],
        )  # fmt: skip
        return output.to(dtype).transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_on_cpu(model: nn.Module, device: torch.device) -> None:
    """Switches a 16-bit model on the CPU from SDPA to `cpu_sdpa` (models with another kernel are left)."""
    if device.type != "cpu" or model.dtype not in SIXTEEN_BIT:
        return
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, cpu_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)

"""SDPA for 16-bit models trained on a CPU: the attention of a training forward computed in fp32.

torch's CPU flash-attention kernel is slow in bf16 where gradients flow: at the trainer's shapes (64 responses of 16
tokens after a shared 8-token prompt, 9 heads of 64) its forward + backward took 23.7 ms in bf16 against 6.5 ms with
q, k and v cast to fp32 first (2 Zen 4 vCPUs, torch 2.14), a sixth of a SmolLM2-135M-shaped model's training pass.
Forwards without gradients (the rollout's decode, reference log-probs) keep the 16-bit kernel, which is the faster
there. The result is cast back to the model's dtype, so the model sees the same dtypes, only more exact attention.
"""

import torch
from torch import nn

NAME = "lorarl_cpu_sdpa"
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def fp32_training_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' SDPA attention, on fp32 copies of q, k and v when gradients flow through 16-bit ones."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if not (torch.is_grad_enabled() and dtype in SIXTEEN_BIT and query.requires_grad):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    output, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                             **kwargs)  # fmt: skip
    return output.to(dtype), weights


def use_for_cpu_training(model: nn.Module, device: torch.device) -> None:
    """Switches a 16-bit model on the CPU from SDPA to `fp32_training_sdpa` (models with another kernel are left)."""
    if device.type != "cpu" or model.dtype not in SIXTEEN_BIT:
        return
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, fp32_training_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)

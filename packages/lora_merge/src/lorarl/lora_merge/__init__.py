"""Fused out-of-place LoRA merge (`W + s·B@A` at memory speed) and layered merged-weight streaming from peft models."""

from lorarl.lora_merge.merge import (
    BACKENDS,
    available_backends,
    cpu_has_native_bf16,
    merge_lora,
    merge_lora_,
    merge_lora_grouped,
)
from lorarl.lora_merge.streaming import (
    LoraFactors,
    adapted_weight_names,
    iter_merged_weights,
    lora_factors,
    merge_factors,
    merged_weight_specs,
)

__all__ = [
    "BACKENDS",
    "LoraFactors",
    "adapted_weight_names",
    "available_backends",
    "cpu_has_native_bf16",
    "iter_merged_weights",
    "lora_factors",
    "merge_factors",
    "merge_lora",
    "merge_lora_",
    "merge_lora_grouped",
    "merged_weight_specs",
]

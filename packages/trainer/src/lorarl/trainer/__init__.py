"""Thin GRPO-family LoRA trainer composing lorarl's packages."""

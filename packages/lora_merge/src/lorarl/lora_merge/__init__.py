"""Fused out-of-place LoRA merge and layered merged-weight streaming (see issue 3)."""

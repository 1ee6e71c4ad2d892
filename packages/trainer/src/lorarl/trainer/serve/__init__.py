"""A Tinker-compatible server: many LoRA training runs and samplers on shared base models (`trainer serve`)."""

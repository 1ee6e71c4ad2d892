"""Thin GRPO-family LoRA trainer composing lorarl's packages."""

import transformers

transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in every process

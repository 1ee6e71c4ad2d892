"""Thin GRPO-family LoRA trainer composing lorarl's packages."""

import os
import sys

# no "Loading weights" bars in every process: transformers reads this when first imported (here, and in the workers
# this process starts), so that importing the trainer (`trainer --help`) need not import transformers itself
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
if "transformers" in sys.modules:  # imported already: tell it directly
    sys.modules["transformers"].utils.logging.disable_progress_bar()

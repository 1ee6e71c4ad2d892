"""A received LoRA adapter written as a peft adapter directory: what peft's `PeftModel.from_pretrained` and vLLM's
`LoRARequest` load."""

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from lorarl.weight_sync.protocol import jsonable


def save_adapter(tensors: Mapping[str, torch.Tensor], config: dict, directory: Path) -> None:
    """`adapter_config.json` (sets and enums as JSON) and `adapter_model.safetensors` in `directory`."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous().cpu() for name, t in tensors.items()}, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(jsonable(config), indent=2))

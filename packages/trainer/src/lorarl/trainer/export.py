"""`trainer export`: a merged full model (base + adapter, merged by `lora_merge`) that `from_pretrained` loads."""

from pathlib import Path

import torch
import yaml

from lorarl.lora_merge import iter_merged_weights
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.models import DTYPES, load_base, load_tokenizer, resolve_model_path


def export_merged(checkpoint: str | Path, out: str | Path) -> Path:
    checkpoint, out = Path(checkpoint), Path(out)
    adapter = checkpoint / "adapter"
    if not checkpoint.is_dir():
        raise TrainerError(f"--checkpoint {checkpoint}: no such directory")
    if not (adapter / "adapter_config.json").is_file():
        raise TrainerError(f"{checkpoint} holds no adapter (a full fine-tune's model/ is already a full model)")
    config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    section = config["model"]
    path = resolve_model_path(section["path"], section.get("gguf_file"), section["dtype"], section.get("revision"))
    from peft import PeftModel

    base = load_base(path, DTYPES[config["model"]["dtype"]], torch.device("cpu"))
    model = PeftModel.from_pretrained(base, str(adapter))
    merged = dict(iter_merged_weights(model))
    target = load_base(path, DTYPES[config["model"]["dtype"]], torch.device("cpu"))
    target.load_state_dict(merged)
    target.save_pretrained(out, safe_serialization=True)
    load_tokenizer(path).save_pretrained(out)
    return out

"""The policy: a Hugging Face causal LM, with a peft LoRA adapter (`model.lora.rank > 0`) or fully trainable (0).

The reference policy for the KL term is the same model with its adapter disabled — no second copy in memory. Only a
full fine-tune with a KL coefficient keeps a frozen copy.
"""

import contextlib
import copy
from pathlib import Path

import torch
from torch import nn

from lorarl.trainer import default_task
from lorarl.trainer.config import LoraSection, ModelSection
from lorarl.trainer.errors import TrainerError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rollout_dtype(name: str, training: torch.dtype, device: torch.device) -> torch.dtype:
    """The rollout engine's dtype (`rollout.dtype`). "auto" samples a float32 model in bfloat16 where the device
    computes it natively — as a vLLM engine serves bf16 while the trainer keeps fp32: on a 2-core AVX512-BF16 CPU the
    decode of a 46M model took 0.64 of its fp32 time (the training log-probs are recomputed in `training` anyway)."""
    if name != "auto":
        return DTYPES[name]
    if training != torch.float32:
        return training
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported()
    else:
        capabilities = torch.cpu.get_capabilities() if device.type == "cpu" else {}
        native = bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))
    return torch.bfloat16 if native else training


def resolve_model_path(path: str) -> Path:
    resolved = default_task.MODEL_DIR if path == "default" else Path(path)
    if not (resolved / "config.json").is_file():
        raise TrainerError(f"model.path={path!r}: {resolved} is not a Hugging Face model directory (no config.json)")
    return resolved


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base(path: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)


class Policy:
    """The trainable model and its reference log-prob context."""

    def __init__(self, section: ModelSection, device: torch.device, *, kl_coef: float):
        self.path = resolve_model_path(section.path)
        self.dtype = DTYPES[section.dtype]
        base = load_base(self.path, self.dtype, device)
        self.is_lora = _uses_lora(section.lora)
        self.frozen_reference = None
        if not self.is_lora:
            self.model = base
            if kl_coef > 0:  # a full fine-tune needs its own frozen reference for the KL term
                self.frozen_reference = copy.deepcopy(base).eval().requires_grad_(False)
        else:
            self.model = _with_adapter(base, section.lora)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference(self):
        """The module computing reference log-probs: the policy with its adapter off, or the frozen copy."""
        if self.frozen_reference is not None:
            yield self.frozen_reference
        elif self.is_lora:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.model


def _uses_lora(lora: LoraSection) -> bool:
    """An adapter is trained unless the rank is 0 (full fine-tuning) and no saved adapter is given."""
    if lora.rank < 0:
        raise TrainerError(f"model.lora.rank must be >= 0 (0 = full fine-tuning), got {lora.rank}")
    return lora.rank > 0 or lora.adapter_path is not None


def _with_adapter(base: nn.Module, lora: LoraSection) -> nn.Module:
    from peft import LoraConfig, PeftModel, get_peft_model

    if lora.adapter_path is not None:
        if not (Path(lora.adapter_path) / "adapter_config.json").is_file():
            raise TrainerError(f"model.lora.adapter_path={lora.adapter_path!r}: no adapter_config.json there")
        return PeftModel.from_pretrained(base, lora.adapter_path, is_trainable=True)
    targets = "all-linear" if list(lora.target_modules) == ["all-linear"] else list(lora.target_modules)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=targets,
        exclude_modules=list(lora.exclude_modules) or None,
        lora_dropout=lora.dropout,
        use_rslora=lora.rslora,
    )
    return get_peft_model(base, config)

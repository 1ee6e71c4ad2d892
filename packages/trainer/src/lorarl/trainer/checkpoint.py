"""Checkpoints: the adapter in peft format (or the full model), plus everything to resume exactly — optimizer,
scheduler, RNG states, data position, step. Written to a temporary directory, then renamed into place, so a crash
mid-write never leaves a checkpoint that looks complete.
"""

import os
import random
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lorarl.trainer.errors import TrainerError

STATE = "trainer_state.pt"


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / "checkpoints" / f"step_{step}"


def save(output_dir: Path, step: int, model: nn.Module, *, is_lora: bool, state: dict, config_yaml: str,
         weights: dict[str, torch.Tensor] | None = None) -> Path:  # fmt: skip
    """`weights`: the state dict to write instead of the model's own (gathered from a sharded model)."""
    final = checkpoint_dir(output_dir, step)
    temporary = final.parent / f".incomplete-{final.name}-{uuid.uuid4().hex[:8]}"
    temporary.mkdir(parents=True)
    extra = {} if weights is None else {"state_dict": weights}
    model.save_pretrained(temporary / ("adapter" if is_lora else "model"), safe_serialization=True, **extra)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}  # noqa: NPY002
    torch.save({**state, "step": step, "rng": rng}, temporary / STATE)
    (temporary / "config.yaml").write_text(config_yaml)
    if final.exists():
        shutil.rmtree(final)
    os.replace(temporary, final)
    return final


def to_resume(resume: str, output_dir: Path) -> Path | None:
    """The checkpoint `trainer.resume` names: none ("never"), the latest in `output_dir` ("auto"; none there: a fresh
    run), or a checkpoint directory."""
    if resume == "never":
        return None
    path = latest(output_dir) if resume == "auto" else Path(resume)
    if path is not None and not (path / STATE).is_file():
        raise TrainerError(f"trainer.resume={resume!r}: {path} is not a checkpoint")
    return path


def latest(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step, if any."""
    found = [p for p in (output_dir / "checkpoints").glob("step_*") if (p / STATE).is_file()]
    return max(found, key=lambda p: int(p.name.removeprefix("step_")), default=None)


def load_weights(path: Path, model: nn.Module, *, is_lora: bool) -> None:
    """The checkpoint's adapter (or full model) into `model` (unsharded: data-parallel ranks load before sharding)."""
    from safetensors.torch import load_file

    if is_lora:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(path / "adapter" / "adapter_model.safetensors")))
    else:
        model.load_state_dict(load_file(str(path / "model" / "model.safetensors")), strict=False)


def load_state(path: Path) -> dict:
    """The saved trainer state (optimizer, scheduler, data position, step); restores the RNG states."""
    state = torch.load(path / STATE, weights_only=False)
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])  # noqa: NPY002 - the global generator is what libraries use
    torch.set_rng_state(state["rng"]["torch"])
    return state


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's full state keyed by parameter names, gathered from a sharded model (a collective then):
    the same file resumes on any number of data-parallel ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

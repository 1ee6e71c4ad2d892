"""Checkpoints: the adapter in peft format (or the full model) — `adapter/` (`model/`) — and the critic, if any
(`critic/`: its peft adapter or model, and `value_head.safetensors`), plus everything to resume exactly: optimizers,
schedules, RNG states, data position, step. Written to a temporary directory, then renamed into place, so a crash
mid-write never leaves a checkpoint that looks complete.
"""

import os
import random
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from lorarl.trainer.errors import TrainerError
from lorarl.trainer.models import Critic

STATE = "trainer_state.pt"
VALUE_HEAD = "value_head.safetensors"


def output_dir(path: str) -> Path:
    """`trainer.output_dir`, created (with its parents) if it does not exist: a clear error before anything loads if
    it cannot be, or is not a directory this process can write to."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise TrainerError(f"trainer.output_dir={path}: {directory} exists and is not a directory") from None
    except OSError as e:
        raise TrainerError(f"trainer.output_dir={path}: cannot create {directory} ({e.strerror or e})") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise TrainerError(f"trainer.output_dir={path}: {directory} is not writable")
    return directory


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / "checkpoints" / f"step_{step}"


def save(output_dir: Path, step: int, write_weights: Callable[[Path], None], *, state: dict, config_yaml: str) -> Path:
    """The checkpoint of `step`: `write_weights(directory)` writes the models (`save_policy`, `save_critic`). Written
    aside and renamed when whole; a save that fails (a full disk, a second Ctrl-C) removes what it wrote."""
    final = checkpoint_dir(output_dir, step)
    temporary = final.parent / f".incomplete-{final.name}-{uuid.uuid4().hex[:8]}"
    temporary.mkdir(parents=True)
    try:
        write_weights(temporary)
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}  # noqa: NPY002
        torch.save({**state, "step": step, "rng": rng}, temporary / STATE)
        (temporary / "config.yaml").write_text(config_yaml)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
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


# what shapes an adapter's weights (or what they compute): a resume under other values would not load, or would
# silently change the model it continues (another model.path may be the same model, moved: its weights tell)
SHAPING = ("rank", "alpha", "target_modules", "exclude_modules", "rslora")


def check_resumable(path: Path, config: Any, *, critic: bool) -> None:
    """A checkpoint resumes only under the settings that shaped it (its `config.yaml`), and with a critic only if it
    holds one: else one error naming the keys, before any weights load."""
    from omegaconf import OmegaConf

    saved_file = path / "config.yaml"
    if not saved_file.is_file():
        return
    saved, now = OmegaConf.load(saved_file), OmegaConf.structured(config)
    if critic and not (path / "critic").is_dir():
        raise TrainerError(f"trainer.resume: {path} holds no critic, and algorithm.adv_estimator="
                           f"{OmegaConf.select(now, 'algorithm.adv_estimator')} trains one; resume under the "
                           f"estimator it was trained with ({OmegaConf.select(saved, 'algorithm.adv_estimator')}), or "
                           "start a fresh run (another trainer.output_dir, or trainer.resume=never)")  # fmt: skip
    sections = ("model", "critic") if critic else ("model",)
    changed = [change for section in sections for change in _changed(saved, now, section)]
    if changed:
        raise TrainerError(f"trainer.resume: {path} was trained with {', '.join(changed)}: its weights are not this "
                           "model's; set those back, or start a fresh run (another trainer.output_dir, or "
                           "trainer.resume=never)")  # fmt: skip


def _changed(saved, now, section: str) -> list[str]:
    """`section.lora.<key>=<saved> (now <now>)` for each shaping key that differs (none for a model fully trained in
    both: no adapter to shape)."""
    from omegaconf import OmegaConf

    def plain(config, key: str):
        value = OmegaConf.select(config, f"{section}.lora.{key}")
        return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value

    values = {key: (plain(saved, key), plain(now, key)) for key in SHAPING}
    if values["rank"] == (0, 0):
        return []
    return [f"{section}.lora.{key}={was} (now {is_now})" for key, (was, is_now) in values.items() if was != is_now]


def latest(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step, if any."""
    found = [p for p in (output_dir / "checkpoints").glob("step_*") if (p / STATE).is_file()]
    return max(found, key=lambda p: int(p.name.removeprefix("step_")), default=None)


def save_policy(directory: Path, model: nn.Module, *, is_lora: bool, weights: dict[str, Tensor] | None) -> None:
    """The policy's adapter (only it: not the critic's beside it) or full model. `weights`: the state dict to write
    instead of the model's own (gathered from a sharded model)."""
    only_policy = {"selected_adapters": ["default"]} if is_lora else {}
    model.save_pretrained(directory / ("adapter" if is_lora else "model"), state_dict=weights, **only_policy)


def save_critic(directory: Path, critic: Critic, *, weights: dict[str, Tensor] | None,
                head: dict[str, Tensor]) -> None:  # fmt: skip
    """The critic's adapter in peft format, or its model, and its value head, in `directory/critic`."""
    if critic.shares_base:  # peft writes an adapter other than "default" into a directory of its name
        critic.model.save_pretrained(directory, selected_adapters=[critic.adapter], state_dict=weights)
    else:
        critic.model.save_pretrained(directory / "critic", state_dict=weights)
    save_file({name: t.contiguous() for name, t in head.items()}, directory / "critic" / VALUE_HEAD)


def load_policy(path: Path, model: nn.Module, *, is_lora: bool) -> None:
    """The checkpoint's adapter (or full model) into `model` (unsharded: data-parallel ranks load before sharding)."""
    _load_into(model, path / ("adapter" if is_lora else "model"), adapter="default" if is_lora else None)


def load_critic(path: Path, critic: Critic) -> None:
    _load_into(critic.model, path / "critic", adapter=critic.adapter if critic.is_lora else None)
    critic.head.load_state_dict(load_file(path / "critic" / VALUE_HEAD))


def _load_into(model: nn.Module, directory: Path, *, adapter: str | None) -> None:
    try:
        if adapter is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(
                model, _read(directory / "adapter_model.safetensors", load_file), adapter_name=adapter
            )
        else:
            model.load_state_dict(_read(directory / "model.safetensors", load_file), strict=False)
    except RuntimeError as e:  # shapes that do not fit: another base model
        detail = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e).splitlines()[0])
        raise TrainerError(f"{directory} does not fit this model ({detail}): was it trained from another "
                           "model.path?") from None  # fmt: skip


def _read(file: Path, read: Callable):
    """`read(file)`, or an error naming the file of a damaged checkpoint."""
    try:
        return read(file)
    except Exception as e:
        raise TrainerError(
            f"cannot read {file} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): the "
            "checkpoint is damaged; resume from another one (trainer.resume=<its directory>)"
        ) from None


def load_state(path: Path) -> dict:
    """The saved trainer state (optimizer, scheduler, data position, step); restores the RNG states."""
    state = _read(path / STATE, lambda file: torch.load(file, weights_only=False))
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])  # noqa: NPY002 - the global generator is what libraries use
    torch.set_rng_state(state["rng"]["torch"])
    return state

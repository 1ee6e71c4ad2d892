"""The trainer's side of the weight sync (`rollout.sync`): after each update the engine gets the merged weights
(base + adapter, streamed one layer at a time), or only the adapter, which it serves unmerged on the base it holds;
`auto` measures both once and keeps the faster."""

import time
from collections.abc import Callable

import torch
from torch import nn

from lorarl.lora_merge import iter_merged_weights, merged_weight_specs
from lorarl.trainer.engines import EngineError, RolloutEngine
from lorarl.trainer.models import adapters
from lorarl.trainer.parallel import DataParallel, full_state_dict
from lorarl.weight_sync import SyncStats

MODES = ("adapter", "merged")


class WeightSync:
    """Sends `model`'s weights (in `dtype`, the engine's) to `engine` as weights version `version`. With data
    parallelism every rank takes part in the gathers and rank 0 — the only one with an engine — sends."""

    def __init__(self, model: nn.Module, *, mode: str, dtype: torch.dtype, dp: DataParallel | None, version: int):
        self.model, self.mode, self.dtype, self.dp, self.version = model, mode, dtype, dp, version
        self.engine: RolloutEngine | None = None  # None on the ranks other than 0

    def sync(self, version: int | None = None, mode: str | None = None) -> SyncStats | None:
        """Stream the merged weights (`mode` "merged"), only the adapter ("adapter"), or the base weights alone
        ("base", the adapter disabled); default: this run's mode and version."""
        version = self.version if version is None else version
        mode = mode or self.mode
        stats = None
        if mode == "base":
            with adapters(self.model, None):
                return self.sync(version, mode="merged")
        if mode == "adapter":
            from peft import get_peft_model_state_dict

            tensors = get_peft_model_state_dict(self.model)
            tensors = full_state_dict(tensors) if self.dp is not None else {k: v.detach() for k, v in tensors.items()}
            if self.engine is not None:
                config = self.model.peft_config["default"].to_dict()
                stats = self.engine.sync_adapter(tensors, config, version=version)
        elif self.engine is not None:
            stats = self.engine.sync_weights(iter_merged_weights(self.model, dtype=self.dtype), version=version,
                                             manifest=merged_weight_specs(self.model, dtype=self.dtype))  # fmt: skip
        else:  # a data-parallel rank other than 0: take part in each layer's gather
            for _ in iter_merged_weights(self.model, dtype=self.dtype):
                pass
        if self.engine is not None and self.engine.version != version:  # the one check, for every engine
            raise EngineError(f"the engine reports version {self.engine.version} after the {mode} sync of "
                              f"version {version}")  # fmt: skip
        self.version = version
        return stats

    def choose(self, generate: Callable[[], object]) -> dict:
        """`rollout.sync=auto`: time one sync and one `generate()` (a rollout batch) with the adapter served unmerged
        and with merged weights; keep the faster for the run. Returns the figures (`sync/auto_*`)."""
        figures = {}
        for mode in MODES:
            started = time.perf_counter()
            self.sync(mode=mode)
            synced = time.perf_counter()
            if self.engine is not None:
                generate()
            figures[f"sync/auto_{mode}_sync_s"] = synced - started
            figures[f"sync/auto_{mode}_generate_s"] = time.perf_counter() - synced
        total = {mode: figures[f"sync/auto_{mode}_sync_s"] + figures[f"sync/auto_{mode}_generate_s"] for mode in MODES}
        choice = min(total, key=total.get)
        self.mode = self.dp.broadcast(choice) if self.dp is not None else choice
        if self.mode == "adapter":  # the engine holds merged weights now: give it the base back to serve on
            self.sync(mode="base")
        return {**figures, "sync/auto_chose_adapter": float(self.mode == "adapter")}


def describe_choice(figures: dict) -> str:
    """`choose`'s figures as the line the console shows."""
    parts = [f"{mode}: sync {figures[f'sync/auto_{mode}_sync_s']:.2f} s + rollout "
             f"{figures[f'sync/auto_{mode}_generate_s']:.2f} s" for mode in MODES]  # fmt: skip
    choice = "adapter" if figures["sync/auto_chose_adapter"] else "merged"
    return f"rollout.sync=auto chose {choice} ({'; '.join(parts)})"

"""The trainer's side of the weight sync (`rollout.sync`): after each update the engine gets the merged weights
(base + adapter, streamed one layer at a time); only the adapter, which it serves unmerged on the base it holds; or
only the LoRA factors, which it merges into its serving weights from a pristine copy of the base (`factors`: the base
weights go with the first sync only); `auto` measures each once and keeps the fastest."""

import time
from collections.abc import Callable

import torch
from torch import nn

from lorarl.lora_merge import iter_merged_weights, lora_factors, merged_weight_specs
from lorarl.trainer.engines import EngineError, RolloutEngine
from lorarl.trainer.models import adapters
from lorarl.trainer.parallel import DataParallel, full_state_dict
from lorarl.weight_sync import SyncStats
from lorarl.weight_sync.factors import factor_set

MODES = ("adapter", "merged", "factors")


class WeightSync:
    """Sends `model`'s weights (in `dtype`, the engine's) to `engine` as weights version `version`. With data
    parallelism every rank takes part in the gathers and rank 0 — the only one with an engine — sends."""

    def __init__(self, model: nn.Module, engine: RolloutEngine | None, *, mode: str, dtype: torch.dtype,
                 dp: DataParallel | None, version: int):  # fmt: skip
        self.model, self.engine, self.mode, self.dtype, self.dp = model, engine, mode, dtype, dp  # no engine: rank > 0
        self.version = version
        self.engine_has_base = False  # the factor sync's base weights went to the engine already
        if mode == "factors" and dp is not None:
            raise EngineError("rollout.sync=factors takes an unsharded adapter: with data-parallel ranks use merged")

    def sync(self, version: int | None = None, mode: str | None = None) -> SyncStats | None:
        """Stream the merged weights (`mode` "merged"), only the adapter ("adapter"), only the LoRA factors
        ("factors"), or the base weights alone ("base", the adapter disabled); default: this run's mode and version."""
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
        elif mode == "factors" and self.engine is not None:
            factors = lora_factors(self.model)
            tensors = factor_set(factors, None if self.engine_has_base else self.base_weights(factors))
            stats = self.engine.sync_factors(tensors, version=version)
            self.engine_has_base = True
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

    def base_weights(self, factors: dict) -> dict[str, torch.Tensor]:
        """The frozen base weights the factors add to, with every tensor of their sibling modules (an engine that
        fuses layers — vLLM's q/k/v with their biases, gate/up — reloads a fused layer whole): the trainer's own."""
        parents = {name.rsplit(".", 2)[0] for name in factors}  # "model.layers.0.self_attn" of ".q_proj.weight"
        with adapters(self.model, None):
            return {name: tensor for name, tensor in iter_merged_weights(self.model)
                    if name.rsplit(".", 2)[0] in parents}  # fmt: skip

    def choose(self, generate: Callable[[], object]) -> dict:
        """`rollout.sync=auto`: time one sync and one `generate()` (a rollout batch) in each mode (factors: its
        second sync, without the base weights); keep the fastest for the run. Returns the figures (`sync/auto_*`)."""
        figures = {}
        modes = MODES if self.dp is None else ("adapter", "merged")
        for mode in modes:
            if mode == "factors":
                self.sync(mode=mode)  # the base weights go with the first
            started = time.perf_counter()
            self.sync(mode=mode)
            synced = time.perf_counter()
            if self.engine is not None:
                generate()
            figures[f"sync/auto_{mode}_sync_s"] = synced - started
            figures[f"sync/auto_{mode}_generate_s"] = time.perf_counter() - synced
        total = {mode: figures[f"sync/auto_{mode}_sync_s"] + figures[f"sync/auto_{mode}_generate_s"] for mode in modes}
        choice = min(total, key=total.get)
        self.mode = self.dp.broadcast(choice) if self.dp is not None else choice
        if self.mode == "adapter":  # the engine holds merged weights now: give it the base back to serve on
            self.sync(mode="base")
        return {**figures, **{f"sync/auto_chose_{mode}": float(self.mode == mode) for mode in modes}}


def describe_choice(figures: dict) -> str:
    """`choose`'s figures as the line the console shows."""
    modes = [mode for mode in MODES if f"sync/auto_{mode}_sync_s" in figures]
    parts = [f"{mode}: sync {figures[f'sync/auto_{mode}_sync_s']:.2f} s + rollout "
             f"{figures[f'sync/auto_{mode}_generate_s']:.2f} s" for mode in modes]  # fmt: skip
    choice = next(mode for mode in modes if figures[f"sync/auto_chose_{mode}"])
    return f"rollout.sync=auto chose {choice} ({'; '.join(parts)})"

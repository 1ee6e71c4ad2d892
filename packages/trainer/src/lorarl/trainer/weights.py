"""The trainer's side of the weight sync: after each update the engine gets one `Update`, made by the run's sync kind
(`rollout.sync`, `sync_kinds.py`; the built-in kinds are the functions below); `auto` measures each kind once and
keeps the fastest."""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from lorarl.lora_merge import adapted_weight_names, iter_merged_weights, lora_factors, merged_weight_specs
from lorarl.trainer.engines import EngineError, RolloutEngine
from lorarl.trainer.models import adapters
from lorarl.trainer.parallel import DataParallel, full_state_dict
from lorarl.trainer.sync_kinds import SYNC_KINDS, SyncKind
from lorarl.weight_sync import SyncStats, Update
from lorarl.weight_sync.factors import factor_set


@dataclass
class SyncSource:
    """What a sync kind makes an update from: the trainer's peft `model`, the engine's `dtype`, the data-parallel
    group (`dp`, None: one rank), the kinds the engine has received so far (`sent`), and whether it keeps its weights
    between updates (`keeps_weights`: an engine asleep at vLLM's level 2 frees them)."""

    model: nn.Module
    dtype: torch.dtype
    dp: DataParallel | None = None
    sent: set[str] = field(default_factory=set)
    keeps_weights: bool = True

    def changing(self) -> Callable[[str], bool] | None:
        """After a first update, what the next ones need to cover: the weights an adapter changes, with every tensor
        of their modules (an engine that fuses layers — vLLM's q/k/v with their biases, gate/up — reloads a fused
        layer whole). None: everything (the engine's first update, an engine that frees its weights, full
        fine-tuning, or data-parallel ranks, whose streams must take part in the same gathers)."""
        if not self.sent or not self.keeps_weights or self.dp is not None or not hasattr(self.model, "peft_config"):
            return None
        modules = {name.rsplit(".", 1)[0] for name in adapted_weight_names(self.model)}
        parents = {name.rsplit(".", 1)[0] for name in modules}
        return lambda name: name.rsplit(".", 2)[0] in parents or name.rsplit(".", 1)[0] in modules


def merged(source: SyncSource, version: int) -> Update:
    """The merged weights W + s·B@A in the engine's dtype, streamed layer by layer (the base untouched); after the
    first update, only the layers the adapter changes (`SyncSource.changing`)."""
    model, dtype, include = source.model, source.dtype, source.changing()
    return Update("weights", version, iter_merged_weights(model, dtype=dtype, include=include),
                  merged_weight_specs(model, dtype=dtype, include=include),
                  coverage="full" if include is None else "subset")  # fmt: skip


def base(source: SyncSource, version: int) -> Update:
    """The base weights alone (the adapter disabled while they stream)."""
    with adapters(source.model, None):
        manifest = merged_weight_specs(source.model, dtype=source.dtype)

    def stream() -> Iterator:
        with adapters(source.model, None):
            yield from iter_merged_weights(source.model, dtype=source.dtype)

    return Update("weights", version, stream(), manifest)


def adapter(source: SyncSource, version: int) -> Update:
    """The adapter's tensors (gathered, with data parallelism) and its peft config."""
    from peft import get_peft_model_state_dict

    tensors = get_peft_model_state_dict(source.model)
    tensors = full_state_dict(tensors) if source.dp is not None else {k: v.detach() for k, v in tensors.items()}
    return Update("adapter", version, tensors, config=source.model.peft_config["default"].to_dict())


def factors(source: SyncSource, version: int) -> Update:
    """The LoRA factors, with the base weights they add to in the first update."""
    found = lora_factors(source.model)
    first = "factors" not in source.sent
    return Update("factors", version, factor_set(found, base_weights(source.model, found) if first else None))


def base_weights(model: nn.Module, factors: dict) -> dict[str, torch.Tensor]:
    """The frozen base weights the factors add to, with every tensor of their sibling modules (an engine that fuses
    layers — vLLM's q/k/v with their biases, gate/up — reloads a fused layer whole): the trainer's own."""
    parents = {name.rsplit(".", 2)[0] for name in factors}  # "model.layers.0.self_attn" of ".q_proj.weight"
    with adapters(model, None):
        return {name: tensor for name, tensor in iter_merged_weights(model) if name.rsplit(".", 2)[0] in parents}


class WeightSync:
    """Sends `model`'s weights (in `dtype`, the engine's) to `engine` as weights version `version`, each sync an
    update of the kind `kind` (a name or import path of `SYNC_KINDS`). With data parallelism every rank builds the
    update (taking part in its gathers) and rank 0 — the only one with an engine — sends it."""

    def __init__(self, model: nn.Module, engine: RolloutEngine | None, *, kind: str, dtype: torch.dtype,
                 dp: DataParallel | None, version: int, forms: tuple[str, ...] | None = None):  # fmt: skip
        self.engine = engine  # None: a data-parallel rank other than 0
        self.forms = forms  # the forms of update the engine can take (None: any); `choose` measures those alone
        self.source = SyncSource(model, dtype, dp, keeps_weights=engine is None or engine.capabilities.keeps_weights)
        self.version = version
        self.kind = self._checked(SYNC_KINDS[kind])

    def _checked(self, kind: SyncKind) -> SyncKind:
        if self.source.dp is not None and not kind.sharded:
            raise EngineError(f"rollout.sync={kind.name} takes an unsharded model: with data-parallel ranks use one of "
                              f"{', '.join(k.name for k in SYNC_KINDS.entries() if k.sharded)}")  # fmt: skip
        return kind

    def sync(self, version: int | None = None, kind: str | SyncKind | None = None) -> SyncStats | None:
        """Send version `version` (default: this sync's) as an update of `kind` (default: this run's)."""
        version = self.version if version is None else version
        kind = self._checked(SYNC_KINDS[kind]) if kind is not None else self.kind
        update = kind.build(self.source, version)
        if not isinstance(update, Update) or update.form != kind.form or update.version != version:
            raise EngineError(f"sync kind {kind.name} ({kind.target}) returned {type(update).__name__} "
                              f"{getattr(update, 'form', '')} version {getattr(update, 'version', '')}; expected a "
                              f"{kind.form} Update of version {version}")  # fmt: skip
        if self.engine is None:  # a data-parallel rank other than 0: take part in the gathers of a stream
            for _ in update.named():
                pass
            stats = None
        else:
            try:
                stats = self.engine.sync(update)
            except Exception as error:
                if isinstance(kind.target, str):  # a built-in kind's failure is lorarl's: its traceback says where
                    raise
                last = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
                raise EngineError(f"rollout.sync={kind.origin}: its version {version} does not fit the engine "
                                  f"({last})") from None  # fmt: skip
            if self.engine.version != version:  # the one check, for every engine
                raise EngineError(f"the engine reports version {self.engine.version} after the {kind.name} sync of "
                                  f"version {version}")  # fmt: skip
        self.source.sent.add(kind.name)
        self.version = version
        return stats

    def choose(self, generate: Callable[[], object]) -> dict:
        """`rollout.sync=auto`: time one sync and one `generate()` (a rollout batch) of each kind marked `auto`
        (a kind whose first update differs from the next — factors, with the base weights — is timed on its
        second); keep the fastest for the run. Returns the figures (`sync/auto_*`)."""
        figures = {}
        dp = self.source.dp
        kinds = [k for k in SYNC_KINDS.entries() if k.auto and (dp is None or k.sharded)
                 and (self.forms is None or k.form in self.forms)]  # fmt: skip
        for kind in kinds:
            self.sync(kind=kind)  # a first update may carry more (the factors' base weights)
            started = time.perf_counter()
            self.sync(kind=kind)
            synced = time.perf_counter()
            if self.engine is not None:
                generate()
            figures[f"sync/auto_{kind.name}_sync_s"] = synced - started
            figures[f"sync/auto_{kind.name}_generate_s"] = time.perf_counter() - synced
        total = {k.name: figures[f"sync/auto_{k.name}_sync_s"] + figures[f"sync/auto_{k.name}_generate_s"]
                 for k in kinds}  # fmt: skip
        choice = min(total, key=total.get)
        self.kind = SYNC_KINDS[dp.broadcast(choice) if dp is not None else choice]
        if self.kind.form == "adapter":  # the engine holds merged weights now: give it the base back to serve on
            self.sync(kind="base")
        return {**figures, **{f"sync/auto_chose_{k.name}": float(self.kind is k) for k in kinds}}


def describe_choice(figures: dict) -> str:
    """`choose`'s figures as the line the console shows."""
    kinds = [k.name for k in SYNC_KINDS.entries() if f"sync/auto_{k.name}_sync_s" in figures]
    parts = [f"{kind}: sync {figures[f'sync/auto_{kind}_sync_s']:.2f} s + rollout "
             f"{figures[f'sync/auto_{kind}_generate_s']:.2f} s" for kind in kinds]  # fmt: skip
    choice = next(kind for kind in kinds if figures[f"sync/auto_chose_{kind}"])
    return f"rollout.sync=auto chose {choice} ({'; '.join(parts)})"

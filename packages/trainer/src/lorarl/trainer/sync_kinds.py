"""Sync kinds: how the trainer makes each weight update it sends the engine — the choices of `rollout.sync`.

A kind is a function `(source: SyncSource, version) -> weight_sync.Update`, registered with `@register_sync_kind`; the
update's form (weights, factors, adapter) is all an engine reads. Built in (`weights.py`):
- `merged`: the merged weights W + s·B@A, streamed layer by layer;
- `adapter`: the adapter alone, served unmerged on the base the engine holds;
- `factors`: the LoRA factors alone, which the engine merges from a pristine copy of the adapted base weights (the
  first update carries them);
- `base`: the base weights alone (the adapter disabled) — what an engine needs before it serves an adapter again.
A plugin kind is one decorated function in the user's file, `rollout.sync=path/to/file.py:name`; `rollout.sync=auto`
measures every kind marked `auto` once and keeps the fastest. This module imports no torch (the configuration reads it).
"""

from dataclasses import dataclass

from lorarl.trainer.registry import Plugin, Registry, import_object

AUTO = "auto"


@dataclass(frozen=True)
class SyncKind(Plugin):
    """A registered sync kind: `target` builds an update (for the built-in ones, its import path, imported when
    used); `form` is the form of the updates it builds; `auto`: `rollout.sync=auto` measures it; `sharded`: it
    works with data-parallel ranks (each rank builds the update, taking part in its gathers; rank 0 sends it)."""

    form: str = "weights"
    auto: bool = True
    sharded: bool = True
    about: str = ""

    @property
    def build(self):
        return import_object(self.target) if isinstance(self.target, str) else self.target

    @property
    def summary(self) -> str:
        return self.about or super().summary


SYNC_KINDS: Registry[SyncKind] = Registry("sync kind", SyncKind, keywords={AUTO: "measure each kind marked auto "
                                                                         "once, keep the fastest"})  # fmt: skip
register_sync_kind = SYNC_KINDS.register

register_sync_kind("merged", about="the merged weights W + s·B@A, streamed layer by layer")(
    "lorarl.trainer.weights:merged"
)
register_sync_kind("adapter", form="adapter", about="the adapter alone, served unmerged on the engine's base")(
    "lorarl.trainer.weights:adapter"
)
FACTORS_ABOUT = "the LoRA factors alone, merged by the engine from a pristine copy of the adapted base weights"
register_sync_kind("factors", form="factors", sharded=False, about=FACTORS_ABOUT)("lorarl.trainer.weights:factors")
register_sync_kind("base", auto=False, about="the base weights alone (the adapter disabled)")(
    "lorarl.trainer.weights:base"
)

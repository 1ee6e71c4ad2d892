"""A sync kind for `benchmarks/sync_modes.py`: the merged weights whole at every update, as lorarl's `merged` sent them
before it sent only the modules an adapter changes (`rollout.sync=benchmarks/plugins/merged_full.py:merged_full`)."""

from dataclasses import replace

from lorarl.trainer.sync_kinds import register_sync_kind
from lorarl.trainer.weights import SyncSource, merged
from lorarl.weight_sync import Update


@register_sync_kind("merged_full", auto=False)
def merged_full(source: SyncSource, version: int) -> Update:
    """The merged weights, every tensor at every update."""
    return merged(replace(source, sent=set()), version)

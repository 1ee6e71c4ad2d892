"""`iter_merged_weights` on an FSDP2-sharded model (2 CPU ranks over gloo) streams exactly what the unsharded
model's `merge_and_unload()` holds, one decoder layer gathered at a time, and leaves the shards untouched."""

import functools

import torch
from fsdp_workers import merged_under_fsdp
from sync_e2e_workers import fingerprint
from sync_processes import run_group
from tiny_models import tiny_lora_qwen2


def test_merged_weights_of_a_sharded_model_equal_the_unsharded_merge():
    outcome = run_group([functools.partial(merged_under_fsdp)] * 2, join=False, deadline=240)
    reference = tiny_lora_qwen2().merge_and_unload().state_dict()  # the same seeds: the same model, unsharded
    for rank in (0, 1):
        status, result = outcome[rank]
        assert status == "ok", result
        assert result["merged"] == fingerprint(reference)  # same keys, bit-identical values, on every rank
        assert result["yielded"] == result["specs"]  # the manifest announced before any gather
        assert result["most_gathered"] == 1  # one decoder layer at a time
        assert result["gathered_after"] == 0
        assert result["unchanged"]
    assert any(t.dtype == torch.bfloat16 for t in reference.values())

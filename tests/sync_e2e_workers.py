"""Processes of the cross-package sync test: a trainer streaming merged weights, an engine holding an HF model."""

import hashlib

import torch
from tiny_models import tiny_lora_qwen2, tiny_qwen2

from lorarl.lora_merge import iter_merged_weights, merged_weight_specs
from lorarl.weight_sync import BucketReceiver, BucketSender


def fingerprint(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, t in state.items()
    }


def trainer(group, rank, bucket_bytes, direct_bytes):
    model = tiny_lora_qwen2()
    sender = BucketSender(group, bucket_bytes=bucket_bytes, verify=True, direct_bytes=direct_bytes)
    stats = sender.send(iter_merged_weights(model), version=1, manifest=merged_weight_specs(model))
    reference = model.merge_and_unload().state_dict()  # peft's own merge, after the transfer
    return {"stats": (stats.tensors, stats.buckets), "reference": fingerprint(reference)}


def engine(group, rank):
    model = tiny_qwen2(dtype=torch.bfloat16, seed=123)  # another copy of the architecture, different weights
    version = BucketReceiver(group).load_into(model)
    return {"version": version, "state": fingerprint(model.state_dict())}

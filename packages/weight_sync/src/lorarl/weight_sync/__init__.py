"""Bucketed weight transfer over torch.distributed (NCCL on GPU, gloo on CPU) into a rollout engine."""

from lorarl.weight_sync.adapter_dir import save_adapter
from lorarl.weight_sync.group import create_sync_group, free_port
from lorarl.weight_sync.local import copy_into
from lorarl.weight_sync.protocol import PROTOCOL_VERSION, ProtocolError, TensorSpec, TransferError
from lorarl.weight_sync.receiver import BucketReceiver, PartialLoadError
from lorarl.weight_sync.sender import DEFAULT_BUCKET_BYTES, BucketSender, SyncStats

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "PROTOCOL_VERSION",
    "BucketReceiver",
    "BucketSender",
    "PartialLoadError",
    "ProtocolError",
    "SyncStats",
    "TensorSpec",
    "TransferError",
    "copy_into",
    "create_sync_group",
    "free_port",
    "save_adapter",
]

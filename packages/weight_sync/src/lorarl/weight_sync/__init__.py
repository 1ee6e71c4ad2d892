"""Weight updates into a rollout engine: an update is a value (`Update`: weights, factors or an adapter, one version),
carried whole by a channel (`channels`: a torch.distributed group over NCCL or gloo, CUDA IPC, or in-process)."""

from lorarl.weight_sync.adapter_dir import save_adapter
from lorarl.weight_sync.channels import CHANNELS, Channel, Link, open_channel, register_channel
from lorarl.weight_sync.group import create_sync_group, free_port
from lorarl.weight_sync.local import copy_into
from lorarl.weight_sync.protocol import PROTOCOL_VERSION, ProtocolError, TensorSpec, TransferError
from lorarl.weight_sync.receiver import BucketReceiver, PartialLoadError
from lorarl.weight_sync.sender import DEFAULT_BUCKET_BYTES, BucketSender, SyncStats
from lorarl.weight_sync.update import FORMS, Update

__all__ = [
    "CHANNELS",
    "DEFAULT_BUCKET_BYTES",
    "FORMS",
    "PROTOCOL_VERSION",
    "BucketReceiver",
    "BucketSender",
    "Channel",
    "Link",
    "PartialLoadError",
    "ProtocolError",
    "SyncStats",
    "TensorSpec",
    "TransferError",
    "Update",
    "copy_into",
    "create_sync_group",
    "free_port",
    "open_channel",
    "register_channel",
    "save_adapter",
]

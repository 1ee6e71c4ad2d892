"""The few collectives a transfer uses, on a process group or a raw backend, each bounded by a timeout."""

from datetime import timedelta

import torch
import torch.distributed as dist

from lorarl.weight_sync.group import backend_of
from lorarl.weight_sync.protocol import TransferError


class Collectives:
    """Broadcasts from `src` and a final status all-reduce over `group` (default: the default process group)."""

    def __init__(self, group: dist.ProcessGroup | None, src: int, device: torch.device | str | None, timeout: float):
        if group is None:
            if not dist.is_initialized():
                raise ValueError(
                    "group is None but torch.distributed is not initialized: pass a group "
                    "(e.g. from lorarl.weight_sync.create_sync_group)"
                )
            group = dist.group.WORLD
        if not 0 <= src < group.size():
            raise ValueError(f"src must be a rank of the group (size {group.size()}), got {src}")
        self.group = group
        self.src = src
        self.rank = group.rank()
        backend = backend_of(group)
        self.device = (
            torch.device(device) if device is not None else torch.device("cuda" if backend == "nccl" else "cpu")
        )
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"an NCCL group moves CUDA tensors; device {self.device} cannot be used")
        self.timeout = timeout

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank = self.src
        return self.group.broadcast([tensor], options)

    def wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except Exception as e:  # gloo: peer closed / timed out; NCCL: watchdog timeout
            raise TransferError(f"{what} failed (peer gone or stalled longer than {self.timeout:g} s): {e}") from e

    def broadcast_bytes(self, raw: bytes | None, what: str) -> bytes:
        """Send (on src) or receive a variable-length byte string: its length, then its bytes."""
        length = torch.tensor([len(raw) if raw is not None else 0], dtype=torch.int64, device=self.device)
        self.wait(self.broadcast(length), what)
        data = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
            if raw is not None
            else torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        )
        if data.numel():
            self.wait(self.broadcast(data), what)
        return bytes(data.cpu().numpy().tobytes())

    def agree_failed(self, failed: bool, what: str) -> bool:
        """All ranks learn whether any rank failed (MAX of 0/1 flags)."""
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self.wait(self.group.allreduce([flag], options), what)
        return bool(flag.item())

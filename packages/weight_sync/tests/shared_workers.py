"""The processes of the shared-bucket tests: a producer posting buckets to a `BucketMailbox`, consumers taking them
(as a colocated trainer and its engine's tensor-parallel workers do). `device="cuda"` shares through CUDA IPC
(`scripts/gpu_check.py` runs them so on a GPU)."""

import os
import signal
import time

import numpy as np
import torch
from sync_workers import SMALL_BUCKET, mixed_tensors

from lorarl.weight_sync.shared import BucketMailbox, share_buckets

TIMEOUT = 20.0


def mailbox(port: int, rank: int, consumers: int = 2, timeout: float = TIMEOUT) -> BucketMailbox:
    return BucketMailbox("127.0.0.1", port, rank=rank, consumers=consumers, timeout=timeout)


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """An owned numpy copy (bf16 as its raw 16 bits): safe to return from a process."""
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).cpu().numpy().copy()


def producer(port: int, rank: int, timeout: float = TIMEOUT, device: str = "cpu") -> list[tuple[int, int, int]]:
    """Two transfers of `mixed_tensors` in small buckets (the packed buffer reused many times)."""
    box = mailbox(port, rank, timeout=timeout)
    share = {"device": device, "bucket_bytes": SMALL_BUCKET, "direct_bytes": 4096}
    transfers = []
    for version, seed in ((3, 0), (4, 1)):
        tensors = {name: tensor.to(device) for name, tensor in mixed_tensors(seed).items()}
        transfers.append(box.post(share_buckets(tensors, version=version, **share)))
    return transfers


def consumer(port: int, rank: int, device: str = "cpu") -> list[tuple[int | None, dict[str, np.ndarray]]]:
    """Take both transfers; each tensor must be a tensor of its own (not a view of the producer's memory)."""
    box = mailbox(port, rank)
    transfers = []
    for _ in range(2):
        received = {}
        for name, tensor in box.receive(device):
            assert name not in received, name
            assert tensor.device.type == device, name
            assert device == "cuda" or not tensor.is_shared(), name  # (CUDA tensors always count as shared)
            received[name] = as_array(tensor)
        transfers.append((box.version, received))
    return transfers


def check_two_transfers(transfers: list[tuple[int | None, dict[str, np.ndarray]]]) -> None:
    """What `consumer` returns: versions 3 and 4, each bit-identical to the `mixed_tensors` of its seed."""
    for (version, received), want_version, seed in zip(transfers, (3, 4), (0, 1), strict=True):
        assert version == want_version, (version, want_version)
        expected = mixed_tensors(seed)
        assert set(received) == set(expected), sorted(set(received) ^ set(expected))
        for name, tensor in expected.items():
            assert np.array_equal(received[name], as_array(tensor.contiguous())), (version, name)


def failing_producer(port: int, rank: int) -> str:
    """Its input raises after a few tensors: the consumers must learn of it."""

    def tensors():
        yield from list(mixed_tensors().items())[:5]
        raise RuntimeError("the merge failed")

    try:
        buckets = share_buckets(tensors(), version=1, device="cpu", bucket_bytes=SMALL_BUCKET, direct_bytes=4096)
        mailbox(port, rank).post(buckets)
    except RuntimeError as e:
        time.sleep(3)  # a trainer lives on after a failed sync: the consumers read the abort notice it left
        return str(e)
    return "no error"


def expect_error(port: int, rank: int) -> str:
    try:
        for _ in mailbox(port, rank).receive("cpu"):
            pass
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def dying_consumer(port: int, rank: int, device: str = "cpu") -> None:
    """Takes the first bucket, then dies (the test harness reports it as died)."""
    for _ in mailbox(port, rank).receive(device):
        os.kill(os.getpid(), signal.SIGKILL)


def stopping_consumer(port: int, rank: int) -> str:
    """Stops after the first tensor (as a `load_weights` that raises does)."""
    next(iter(mailbox(port, rank).receive("cpu")))
    return "stopped"

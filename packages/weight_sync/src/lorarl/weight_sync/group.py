"""A process group of its own between a trainer and rollout-engine processes that did not start together."""

import socket
from datetime import timedelta

import torch.distributed as dist

GLOO_THREADS = 8
"""Worker threads of a gloo sync group (torch's default is 2): a transfer keeps one broadcast in flight per large
tensor; with 8 they need not queue behind each other (measured no slower in `benchmarks/sync_throughput.py`)."""


def create_sync_group(
    host: str,
    port: int,
    world_size: int,
    rank: int,
    *,
    backend: str = "gloo",
    timeout: float = 300.0,
    gloo_threads: int = GLOO_THREADS,
) -> dist.ProcessGroup:
    """Join a `world_size`-process group by TCP-store rendezvous on `host:port` (rank 0 hosts the store).

    Independent of any default group the processes may already have (an engine's tensor-parallel group, a trainer's
    data-parallel group): it is what vLLM worker extensions need. `backend`: "gloo" (CPU tensors) or "nccl" (CUDA
    tensors; each process must have its CUDA device set). Every collective on it fails after `timeout` seconds.
    `gloo_threads`: worker threads of a gloo group (collectives it runs at once).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size) = [0, {world_size}), got {rank}")
    if gloo_threads < 1:
        raise ValueError(f"gloo_threads must be >= 1, got {gloo_threads}")
    limit = timedelta(seconds=timeout)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=limit, wait_for_workers=True)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = limit
        options._threads = gloo_threads
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = limit
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def backend_of(group: dist.ProcessGroup) -> str:
    """ "gloo" or "nccl" (or another backend name) of a process group or a raw backend object."""
    try:
        return dist.get_backend(group)
    except (RuntimeError, ValueError, AttributeError):
        return group.name()

"""A process group of its own between a trainer and rollout-engine processes that did not start together.

Where every member is on this machine (the rendezvous host is a loopback address), nothing of the group listens
beyond loopback: torch's TCPStore binds every interface unless handed a socket bound already, and gloo's pairs listen
on the address their device is made for. A TCPStore accepts anyone who connects."""

import ipaddress
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
    store = rendezvous_store(host, port, world_size, rank, limit)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = limit
        options._threads = gloo_threads
        options._devices = [gloo_device(host)]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = limit
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback (127.0.0.0/8, ::1, localhost)."""
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0]).is_loopback
    except (OSError, ValueError):
        return False


def rendezvous_store(host: str, port: int, world_size: int, rank: int, timeout: timedelta) -> dist.TCPStore:
    """The group's TCPStore: hosted by rank 0, on `host` alone where it is a loopback address (torch's own would
    listen on every interface), waiting for the other ranks to join."""
    listen_fd = None
    if rank == 0 and is_loopback(host):
        listen_fd = socket.create_server((host, port), backlog=max(128, world_size)).detach()  # the store's now
    return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True,
                         master_listen_fd=listen_fd)  # fmt: skip


def gloo_device(host: str):
    """Where a gloo group's pairs listen: loopback where the rendezvous is (every member is on this machine), else
    gloo's default (GLOO_SOCKET_IFNAME, or the address of this machine's hostname)."""
    if is_loopback(host):
        return dist.ProcessGroupGloo.create_device(hostname=host)
    return dist.ProcessGroupGloo.create_default_device()


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

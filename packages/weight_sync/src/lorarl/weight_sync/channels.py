"""Channels: the ways an `Update` travels from the trainer (rank 0) to an engine's workers (ranks 1..), one class per
mechanism behind one interface, chosen by name from a registry (as vLLM chooses its weight-transfer engines).

    gloo, nccl   a torch.distributed group of their own: lorarl's bucketed, checksummed, versioned transfer
                 (`BucketSender` / `BucketReceiver`), CPU tensors over gloo, GPU tensors over NCCL
    ipc          shared buckets of CUDA IPC handles (`BucketMailbox`): workers on the trainer's own GPUs
    local        the tensors themselves, handed to a worker of the same process (no wire, no copy)

Every channel delivers a version whole and checked or raises (within its timeout), so a receiver never applies part
of one. A new mechanism is one `Channel` subclass and `register_channel`.
"""

import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from lorarl.weight_sync.group import create_sync_group, free_port
from lorarl.weight_sync.local import copy_into
from lorarl.weight_sync.protocol import TensorSpec, TransferError
from lorarl.weight_sync.receiver import BucketReceiver
from lorarl.weight_sync.sender import DEFAULT_BUCKET_BYTES, BucketSender, SyncStats, check_pair
from lorarl.weight_sync.shared import BucketMailbox, share_buckets
from lorarl.weight_sync.update import FORMS, Update


@dataclass(frozen=True)
class Link:
    """Where a channel's ends meet: the sender is rank 0, the `receivers` receivers ranks 1..receivers, `host:port`
    their rendezvous (a group's store, the mailbox's, or — `local` — just the key of this link); every wait is
    bounded by `timeout` seconds."""

    host: str = "127.0.0.1"
    port: int = 0
    receivers: int = 1
    timeout: float = 300.0

    @property
    def world_size(self) -> int:
        return self.receivers + 1


class Channel(ABC):
    """One end (`rank` 0 sends, the others receive) of a mechanism that carries updates. `device`: where the
    sender's buffers and a receiver's tensors live (default: the mechanism's); `bucket_bytes`, `verify`: for
    mechanisms that send buckets (checksummed with `verify`)."""

    name: ClassVar[str]
    forms: ClassVar[tuple[str, ...]] = FORMS  # the forms it carries
    opens_together: ClassVar[bool] = True  # the ends open at once (a rendezvous); else the sender's end first
    # `send` completes before a receiver takes the update, which is the sender's own tensors (the same process): a
    # receiver copies what it keeps and the sender changes
    hands_over: ClassVar[bool] = False

    def __init__(self, link: Link, rank: int, *, device: torch.device | str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify: bool = True):  # fmt: skip
        if not 0 <= rank <= link.receivers:
            raise ValueError(f"rank must lie in [0, {link.receivers}] for a link to {link.receivers} receivers, got "
                             f"{rank}")  # fmt: skip
        self.link, self.rank = link, rank

    def send(self, update: Update) -> SyncStats:
        """Sender: deliver `update` to every receiver; returns once each has it (or, `hands_over`, once it is
        left for them). Raises if a receiver failed, died or stalled past the timeout."""
        if update.form not in self.forms:
            raise ValueError(f"the {self.name!r} channel carries {', '.join(self.forms)} updates, not "
                             f"{update.form!r}")  # fmt: skip
        return self._send(update)

    @abstractmethod
    def _send(self, update: Update) -> SyncStats: ...

    @abstractmethod
    def receive(self, form: str, version: int) -> Update:
        """Receiver: the update the sender sends as `version` in `form`, in tensors of the receiver's own (unless
        `hands_over`). Factors and adapters come whole and checked; weights as a stream checked as it is consumed, which
        must be consumed to its end (stopping early tells the sender this receiver failed)."""

    def received_coverage(self, update: Update) -> str:
        """Receiver: what `update`, received here and consumed, covers as its sender said (`Update.coverage`)."""
        return update.coverage

    def load_into(self, module: nn.Module, version: int) -> int:
        """Receiver: weights version `version` copied into `module`'s parameters and buffers of the same names, the
        manifest checked against the module before anything is applied (`weight_sync.copy_into`); returns it."""
        update = self.receive("weights", version)
        stream = iter(update.named())
        try:
            return copy_into(module, stream, version=version, manifest=update.specs, strict=update.full).version
        finally:
            getattr(stream, "close", lambda: None)()  # a stream left early drains and tells the sender

    @classmethod
    def new_link(cls, receivers: int, *, host: str = "127.0.0.1", timeout: float = 300.0) -> Link:
        """A link for this mechanism to `receivers` receivers (a free port on `host`)."""
        return Link(host, free_port(host), receivers, timeout)

    def close(self) -> None:  # noqa: B027 (most mechanisms hold nothing to release)
        """Release what the channel holds."""


CHANNELS: dict[str, type[Channel]] = {}


def register_channel(name: str) -> Callable[[type[Channel]], type[Channel]]:
    """A class decorator: the mechanism `name` (a choice wherever a channel is named, e.g. vLLM's init info)."""

    def add(cls: type[Channel]) -> type[Channel]:
        if name in CHANNELS:
            raise ValueError(f"channel {name!r} is registered already")
        CHANNELS[name] = cls
        return cls

    return add


def channel_class(name: str) -> type[Channel]:
    if name not in CHANNELS:
        raise ValueError(f"unknown channel {name!r}: expected one of {', '.join(CHANNELS)}")
    return CHANNELS[name]


def open_channel(name: str, link: Link, rank: int, **options) -> Channel:
    """The end `rank` of channel `name` over `link` (blocks until the ends meet, where the mechanism has them)."""
    return channel_class(name)(link, rank, **options)


def expected_version(received: int | None, version: int) -> int:
    """`received`, which must be the version announced."""
    if received != version:
        raise TransferError(f"the trainer announced version {version} but sent version {received}")
    return received


# --- a torch.distributed group ------------------------------------------------------------------------------------


class _GroupChannel(Channel):
    """A sync group of its own: lorarl's bucketed transfer (every bucket checksummed with `verify`), large tensors
    landing straight in a module's parameters (`load_into`) or in tensors of the receiver's own."""

    backend: ClassVar[str]

    def __init__(self, link: Link, rank: int, *, device: torch.device | str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify: bool = True):  # fmt: skip
        super().__init__(link, rank)
        group = create_sync_group(link.host, link.port, link.world_size, rank, backend=self.backend,
                                  timeout=link.timeout)  # fmt: skip
        if rank == 0:
            self.sender = BucketSender(group, bucket_bytes=bucket_bytes, device=device, timeout=link.timeout,
                                       verify=verify)  # fmt: skip
        else:
            self.receiver = BucketReceiver(group, device=device, timeout=link.timeout)

    def _send(self, update: Update) -> SyncStats:
        if update.form == "adapter":
            return self.sender.send_adapter(update.tensors, update.config, version=update.version)
        return self.sender.send(update.tensors, version=update.version, manifest=update.manifest,
                                coverage=update.coverage)  # fmt: skip

    def receive(self, form: str, version: int) -> Update:
        if form == "adapter":
            tensors, config, received = self.receiver.receive_adapter()
            return Update(form, expected_version(received, version), tensors, config=config)
        if form == "factors":
            tensors = dict(self.receiver.receive(keep=True))
            return Update(form, expected_version(self.receiver.version, version), tensors)
        return Update(form, version, self._checked_stream(version))

    def _checked_stream(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.receiver.receive(keep=True)
        expected_version(self.receiver.version, version)

    def received_coverage(self, update: Update) -> str:
        return self.receiver.coverage if update.form == "weights" else update.coverage  # the transfer's header's

    def load_into(self, module: nn.Module, version: int) -> int:
        return expected_version(self.receiver.load_into(module), version)


@register_channel("gloo")
class GlooChannel(_GroupChannel):
    """CPU tensors (the sender's are copied into CPU buckets; a receiver's land on the CPU)."""

    backend = "gloo"

    def __init__(self, link: Link, rank: int, *, device: torch.device | str | None = None, **options):
        super().__init__(link, rank, device="cpu", **options)


@register_channel("nccl")
class NcclChannel(_GroupChannel):
    backend = "nccl"


# --- CUDA IPC -------------------------------------------------------------------------------------------------------


@register_channel("ipc")
class IpcChannel(Channel):
    """Shared buckets of the sender's memory (CUDA IPC handles on GPUs, shared memory on the CPU), handed through a
    `BucketMailbox` whose store the sender hosts: each bucket is copied out by every receiver before the next is
    packed."""

    forms = ("weights", "factors")
    opens_together = False

    def __init__(self, link: Link, rank: int, *, device: torch.device | str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify: bool = True):  # fmt: skip
        super().__init__(link, rank)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.bucket_bytes = bucket_bytes
        self.mailbox = BucketMailbox(link.host, link.port, rank=rank, consumers=link.receivers,
                                     timeout=link.timeout)  # fmt: skip

    def _send(self, update: Update) -> SyncStats:
        started = time.perf_counter()
        buckets = share_buckets(update.named(), version=update.version, device=self.device,
                                bucket_bytes=self.bucket_bytes, manifest=update.specs)  # fmt: skip
        tensors, nbytes, count = self.mailbox.post(buckets)
        return SyncStats(update.version, tensors, nbytes, count, time.perf_counter() - started)

    def receive(self, form: str, version: int) -> Update:
        if form == "factors":
            tensors = dict(self.mailbox.receive(self.device))
            return Update(form, expected_version(self.mailbox.version, version), tensors)
        return Update(form, version, self._checked_stream(version))

    def _checked_stream(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.mailbox.receive(self.device)
        expected_version(self.mailbox.version, version)


# --- the same process -----------------------------------------------------------------------------------------------

_handoffs: dict[tuple[int, int], Update] = {}
_handoff_ready = threading.Condition()
_local_links = itertools.count(1)


@register_channel("local")
class LocalChannel(Channel):
    """The tensors themselves, left for a receiver of the same process (one: this process's), checked against the
    manifest as the receiver takes them and counted, as a wire would."""

    opens_together = False
    hands_over = True

    @classmethod
    def new_link(cls, receivers: int, *, host: str = "127.0.0.1", timeout: float = 300.0) -> Link:
        """A link of its own (its port is the key its handovers go under)."""
        return Link(host, next(_local_links), receivers, timeout)

    def __init__(self, link: Link, rank: int, **options):
        super().__init__(link, rank)
        if link.receivers != 1:
            raise ValueError(f"the 'local' channel reaches one receiver (this process's), not {link.receivers}")

    def _send(self, update: Update) -> SyncStats:
        """Leaves the update; the stats count a stream's tensors as the receiver takes them."""
        stats = SyncStats(update.version, 0, 0, 0, 0.0)
        if isinstance(update.tensors, Mapping):
            stats.tensors = len(update.tensors)
            stats.bytes = sum(t.numel() * t.element_size() for t in update.tensors.values())
            handed = update
        else:
            handed = replace(update, tensors=_checked(update.tensors, update.specs, stats))
        with _handoff_ready:
            for stale in [key for key in _handoffs if key[0] == self.link.port]:  # left by a receiver that failed
                del _handoffs[stale]
            _handoffs[self.link.port, update.version] = handed
            _handoff_ready.notify_all()
        return stats

    def receive(self, form: str, version: int) -> Update:
        with _handoff_ready:
            if not _handoff_ready.wait_for(lambda: (self.link.port, version) in _handoffs, self.link.timeout):
                raise TransferError(f"no version {version} was handed over within {self.link.timeout:g} s (the "
                                    f"'local' channel needs the trainer's process)")  # fmt: skip
            update = _handoffs.pop((self.link.port, version))
        if update.form != form:
            raise TransferError(f"version {version} was handed over as {update.form}, expected {form}")
        return update


def _checked(
    pairs: Iterable[tuple[str, torch.Tensor]], specs: list[TensorSpec] | None, stats: SyncStats
) -> Iterator[tuple[str, torch.Tensor]]:
    """Named tensors handed over in-process: checked against the manifest (when given) as `BucketSender.send`
    checks them, and counted into `stats`, as they are taken (a merged stream is computed as the receiver loads
    it)."""
    for name, tensor in pairs:
        check_pair(specs, stats.tensors, name, tensor)
        stats.tensors += 1
        stats.bytes += tensor.numel() * tensor.element_size()
        yield name, tensor
    if specs is not None and stats.tensors != len(specs):
        raise ValueError(f"the input yielded {stats.tensors} tensors but the manifest lists {len(specs)}")

"""`BucketSender`: stream named tensors to every other rank of a group, packed into fixed-size buckets.

Two bucket buffers alternate: bucket k+1 is packed (and the input iterator — e.g. `iter_merged_weights`, which
computes merges — advanced) while bucket k is in flight.
"""

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lorarl.weight_sync.protocol import (
    ALIGN,
    BucketHeader,
    Entry,
    TensorSpec,
    TransferError,
    TransferHeader,
    align,
    checksum,
    payload_start,
    write_header,
)
from lorarl.weight_sync.transport import Channel

DEFAULT_BUCKET_BYTES = 64 << 20  # chosen by benchmarks/sync_throughput.py (see the package README)
NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


@dataclass
class SyncStats:
    version: int
    tensors: int
    bytes: int  # tensor bytes sent
    buckets: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


class BucketSender:
    """The sending side (rank `src` of `group`). `bucket_bytes` per broadcast; `verify` adds per-bucket checksums."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        src: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str | None = None,
        timeout: float = 300.0,
        verify: bool = False,
    ):
        self.channel = Channel(group, src, device, timeout)
        if self.channel.rank != src:
            raise ValueError(f"BucketSender runs on the src rank ({src}); this process is rank {self.channel.rank}")
        if bucket_bytes < 4 * ALIGN + 4096:
            raise ValueError(f"bucket_bytes must be at least {4 * ALIGN + 4096}, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.verify = verify
        self._buffers: list[torch.Tensor] = []

    def send(
        self, named_tensors: NamedTensors, *, version: int, manifest: Sequence[TensorSpec | tuple] | None = None
    ) -> SyncStats:
        """Send every `(name, tensor)` as transfer `version`; returns once all receivers applied it.

        A Mapping or a list gives the manifest by itself; for a lazy iterator pass `manifest` (the names, dtypes and
        shapes it will yield, in order: `TensorSpec`s or `(name, shape, torch.dtype)` tuples, e.g. from
        `lora_merge.merged_weight_specs`) so receivers can validate the whole transfer before applying anything.
        Raises `TransferError` if a receiver died, stalled past the timeout, or failed to apply the transfer.
        """
        if isinstance(named_tensors, Mapping):
            pairs = list(named_tensors.items())
        elif isinstance(named_tensors, Sequence):
            pairs = list(named_tensors)
        else:
            pairs = named_tensors
        if manifest is None and isinstance(pairs, list):
            manifest = [TensorSpec.of(name, tensor) for name, tensor in pairs]
        manifest = [TensorSpec.coerce(spec) for spec in manifest] if manifest is not None else None
        header = TransferHeader(version, "weights", self.bucket_bytes, self.verify, manifest)
        return self._transfer(header, pairs)

    def send_adapter(self, tensors: Mapping[str, torch.Tensor], config: dict, *, version: int) -> SyncStats:
        """Send only a LoRA adapter (its tensors and peft config), for engines that serve it unmerged."""
        manifest = [TensorSpec.of(name, tensor) for name, tensor in tensors.items()]
        header = TransferHeader(version, "adapter", self.bucket_bytes, self.verify, manifest, adapter_config=config)
        return self._transfer(header, tensors.items())

    def _transfer(self, header: TransferHeader, pairs: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        started = time.perf_counter()
        channel = self.channel
        channel.broadcast_bytes(header.encode(), f"version {header.version}: transfer header")
        if len(self._buffers) != 2 or self._buffers[0].device != channel.device:
            self._buffers = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=channel.device) for _ in range(2)]
        in_flight: list[dist.Work | None] = [None, None]
        stats = SyncStats(header.version, 0, 0, 0, 0.0)
        buckets = _Packer(self.bucket_bytes, header.manifest).buckets(pairs)
        try:
            for bucket, parts in buckets:
                slot = bucket.index % 2
                if in_flight[slot] is not None:
                    channel.wait(in_flight[slot], f"version {header.version}: bucket {bucket.index - 2}")
                self._pack(self._buffers[slot], bucket, parts)
                in_flight[slot] = channel.broadcast(self._buffers[slot])
                stats.buckets += 1
                stats.bytes += sum(e.length for e in bucket.entries)
                stats.tensors += sum(e.completes for e in bucket.entries)
        except TransferError:
            raise
        except Exception as error:  # the input failed (e.g. a merge raised): tell the receivers, then re-raise
            for work in in_flight:
                if work is not None:
                    channel.wait(work, f"version {header.version}: bucket before abort")
            abort = BucketHeader(stats.buckets, last=True, abort=f"{type(error).__name__}: {error}")
            write_header(self._buffers[0], abort)
            channel.wait(channel.broadcast(self._buffers[0]), f"version {header.version}: abort notice")
            channel.agree_failed(True, f"version {header.version}: status")
            raise
        for index, work in enumerate(in_flight):
            if work is not None:
                channel.wait(work, f"version {header.version}: final buckets ({index})")
        if channel.agree_failed(False, f"version {header.version}: status"):
            raise TransferError(f"a receiver failed to apply version {header.version} (see its own error)")
        stats.seconds = time.perf_counter() - started
        return stats

    def _pack(self, buffer: torch.Tensor, bucket: BucketHeader, parts: list[torch.Tensor]) -> None:
        for entry, part in zip(bucket.entries, parts, strict=True):
            start = bucket.payload_offset + entry.offset
            buffer[start : start + entry.length].copy_(part)
        if self.verify:
            used = align(max((e.offset + e.length for e in bucket.entries), default=0))
            bucket.checksum = checksum(buffer[bucket.payload_offset : bucket.payload_offset + used])
        write_header(buffer, bucket)


class _Packer:
    """Cuts a stream of tensors into buckets: whole tensors where they fit, byte ranges of big ones otherwise."""

    def __init__(self, bucket_bytes: int, manifest: list[TensorSpec] | None):
        self.capacity = bucket_bytes
        self.manifest = manifest

    def buckets(self, pairs: Iterable[tuple[str, torch.Tensor]]):
        """Yields `(BucketHeader, parts)`: `parts[i]` is the uint8 view holding `entries[i]`'s bytes."""
        index, entries, parts, used = 0, [], [], 0
        count = 0
        for name, tensor in pairs:
            spec = self._check(count, name, tensor)
            count += 1
            raw = _bytes_of(tensor)
            start = 0
            while True:
                offset = align(used)
                room = self.capacity - payload_start(BucketHeader.size_bound([*entries, Entry(spec, 0, 0, 0)])) - offset
                rest = raw.numel() - start
                if room < min(rest, ALIGN) or (room <= 0 and rest == 0):
                    if not entries:
                        raise ValueError(f"bucket_bytes={self.capacity} cannot hold even the header of {name!r}")
                    yield self._bucket(index, False, entries), parts
                    index, entries, parts, used = index + 1, [], [], 0
                    continue
                take = min(rest, room)
                entries.append(Entry(spec, start, take, offset))
                parts.append(raw[start : start + take])
                used = offset + take
                start += take
                if start == raw.numel():
                    break
        if self.manifest is not None and count != len(self.manifest):
            raise ValueError(f"the input yielded {count} tensors but the manifest lists {len(self.manifest)}")
        yield self._bucket(index, True, entries), parts

    def _bucket(self, index: int, last: bool, entries: list[Entry]) -> BucketHeader:
        return BucketHeader(index, last, payload_start(BucketHeader.size_bound(entries)), entries)

    def _check(self, count: int, name: str, tensor: torch.Tensor) -> TensorSpec:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"named_tensors must yield (str, Tensor) pairs, got ({type(name).__name__}, {type(tensor).__name__})"
            )
        spec = TensorSpec.of(name, tensor)
        if self.manifest is not None and (count >= len(self.manifest) or self.manifest[count] != spec):
            expected = self.manifest[count] if count < len(self.manifest) else "nothing more"
            raise ValueError(f"tensor #{count} {spec} does not match the manifest ({expected})")
        return spec


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (a contiguous copy first if it is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)

"""`BucketSender`: stream named tensors to every other rank of a group, in buckets.

Small tensors are packed into a bucket's payload; large ones (`direct_bytes` and up) are broadcast straight from
their own memory, so they are never copied. A bucket carries at most `bucket_bytes`: that bounds what is in flight,
not what is allocated (a payload is exactly as large as what it packs). Two buckets alternate in flight: bucket k+1 is
packed (and the input iterator — e.g. `iter_merged_weights`, which computes merges — advanced) while bucket k is sent.
"""

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lorarl.weight_sync.gc_pause import gc_paused
from lorarl.weight_sync.protocol import (
    ALIGN,
    CONTROL_BYTES,
    INLINE_HEADER_BYTES,
    BucketHeader,
    Entry,
    TensorSpec,
    TransferError,
    TransferHeader,
    align,
    checksum,
    jsonable,
)
from lorarl.weight_sync.transport import Collectives

DEFAULT_BUCKET_BYTES = 256 << 20  # chosen by benchmarks/sync_throughput.py (see the package README)
DEFAULT_DIRECT_BYTES = 1 << 20  # tensors this large are sent from their own memory rather than packed
PACKED_BYTES = 16 << 20  # a bucket packs at most this much: small tensors in several buckets pipeline (pack/send/apply)
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
    """The sending side (rank `src` of `group`). Broadcasts carry at most `bucket_bytes`; tensors of at least
    `direct_bytes` are sent from their own memory; `verify` adds checksums."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        src: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str | None = None,
        timeout: float = 300.0,
        verify: bool = False,
        direct_bytes: int = DEFAULT_DIRECT_BYTES,
    ):
        self.wire = Collectives(group, src, device, timeout)
        if self.wire.rank != src:
            raise ValueError(f"BucketSender runs on the src rank ({src}); this process is rank {self.wire.rank}")
        if bucket_bytes < 4 * ALIGN + 4096:
            raise ValueError(f"bucket_bytes must be at least {4 * ALIGN + 4096}, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.direct_bytes = direct_bytes
        self.verify = verify

    @gc_paused()
    def send(
        self,
        named_tensors: NamedTensors,
        *,
        version: int,
        manifest: Sequence[TensorSpec | tuple] | None = None,
        coverage: str = "full",
    ) -> SyncStats:
        """Send every `(name, tensor)` as transfer `version`; returns once all receivers applied it.

        A Mapping or a list gives the manifest by itself; for a lazy iterator pass `manifest` (the names, dtypes and
        shapes it will yield, in order: `TensorSpec`s or `(name, shape, torch.dtype)` tuples, e.g. from
        `lora_merge.merged_weight_specs`) so receivers can validate the whole transfer before applying anything.
        `coverage`: `full` (every weight of the receivers' model: one that lacks any refuses it) or `subset`.
        Raises `TransferError` if a receiver died, stalled past the timeout, or failed to apply the transfer.
        """
        pairs = pairs_of(named_tensors)
        own_manifest = manifest is None and isinstance(pairs, list)
        if own_manifest:
            manifest = [TensorSpec.of(name, tensor) for name, tensor in pairs]
        manifest = [TensorSpec.coerce(spec) for spec in manifest] if manifest is not None else None
        header = TransferHeader(version, "weights", self.bucket_bytes, self.verify, manifest, coverage=coverage)
        return self._transfer(header, pairs, trusted_manifest=own_manifest)

    @gc_paused()
    def send_adapter(self, tensors: Mapping[str, torch.Tensor], config: dict, *, version: int) -> SyncStats:
        """Send only a LoRA adapter (its tensors and peft config, e.g. `peft_config.to_dict()`: sets and enums are
        written as JSON lists and values), for engines that serve it unmerged."""
        manifest = [TensorSpec.of(name, tensor) for name, tensor in tensors.items()]
        header = TransferHeader(version, "adapter", self.bucket_bytes, self.verify, manifest,
                                adapter_config=jsonable(config))  # fmt: skip
        return self._transfer(header, tensors.items(), trusted_manifest=True)

    def _transfer(
        self, header: TransferHeader, pairs: Iterable[tuple[str, torch.Tensor]], *, trusted_manifest: bool = False
    ) -> SyncStats:
        started = time.perf_counter()
        wire = self.wire
        wire.broadcast_bytes(header.encode(), f"version {header.version}: transfer header")
        slots: list[list[tuple[dist.Work, torch.Tensor]]] = [[], []]  # in-flight broadcasts and what they read
        stats = SyncStats(header.version, 0, 0, 0, 0.0)
        try:
            packer = _Packer(self.bucket_bytes, self.direct_bytes, header.manifest, trusted_manifest)
            for bucket, packed, direct in packer.buckets(pairs):
                slot = slots[bucket.index % 2]
                self._drain(slot, f"version {header.version}: bucket {bucket.index - 2}")
                slot += self._launch(bucket, packed, direct)
                stats.buckets += 1
                stats.bytes += sum(e.length for e in bucket.entries)
                stats.tensors += sum(e.completes for e in bucket.entries)
        except TransferError:
            raise
        except Exception as error:  # the input failed (e.g. a merge raised): tell the receivers, then re-raise
            for slot in slots:
                self._drain(slot, f"version {header.version}: bucket before abort")
            abort = BucketHeader(stats.buckets, last=True, abort=f"{type(error).__name__}: {error}")
            self._drain(self._launch(abort, [], []), f"version {header.version}: abort notice")
            wire.agree_failed(True, f"version {header.version}: status")
            raise
        for slot in slots:
            self._drain(slot, f"version {header.version}: last buckets")
        if wire.agree_failed(False, f"version {header.version}: status"):
            raise TransferError(f"a receiver failed to apply version {header.version} (see its own error)")
        stats.seconds = time.perf_counter() - started
        return stats

    def _launch(
        self, bucket: BucketHeader, packed: list[torch.Tensor], direct: list[torch.Tensor]
    ) -> list[tuple[dist.Work, torch.Tensor]]:
        """Pack the small tensors into a payload of exactly their size, then start the bucket's broadcasts
        (asynchronously, in order). Each in-flight bucket keeps what its broadcasts read alive."""
        payload = torch.empty(bucket.payload_bytes, dtype=torch.uint8, device=self.wire.device)
        for entry, part in zip(bucket.packed, packed, strict=True):
            payload[entry.offset : entry.offset + entry.length].copy_(part)
        if self.verify:
            bucket.checksums = [checksum(payload), *(checksum(part) for part in direct)]
        raw = bucket.encode()
        control = bytearray(CONTROL_BYTES)
        control[:16] = len(raw).to_bytes(8, "little") + payload.numel().to_bytes(8, "little")
        control[16 : 16 + min(len(raw), INLINE_HEADER_BYTES)] = raw[:INLINE_HEADER_BYTES]
        messages = [torch.frombuffer(control, dtype=torch.uint8).to(self.wire.device)]
        if len(raw) > INLINE_HEADER_BYTES:
            overflow = bytearray(raw[INLINE_HEADER_BYTES:])
            messages.append(torch.frombuffer(overflow, dtype=torch.uint8).to(self.wire.device))
        messages += [*([payload] if payload.numel() else []), *direct]
        return [(self.wire.broadcast(message), message) for message in messages]

    def _drain(self, slot: list[tuple[dist.Work, torch.Tensor]], what: str) -> None:
        for work, _ in slot:
            self.wire.wait(work, what)
        slot.clear()


class _Packer:
    """Cuts a stream of tensors into buckets: small tensors packed (split where a bucket fills up), large ones as
    direct chunks of at most a bucket each. A `trusted` manifest was made from the very tensors sent."""

    def __init__(self, bucket_bytes: int, direct_bytes: int, manifest: list[TensorSpec] | None, trusted: bool = False):
        self.capacity = bucket_bytes
        self.packed_capacity = min(bucket_bytes, PACKED_BYTES)
        self.direct_from = min(direct_bytes, bucket_bytes)
        self.manifest = manifest
        self.trusted = trusted

    def buckets(self, pairs: Iterable[tuple[str, torch.Tensor]]):
        """Yields `(BucketHeader, packed parts, direct parts)`: uint8 views holding each entry's bytes, so that a
        bucket carries at most `capacity` bytes in all."""
        index, entries, packed, direct, used, direct_total = 0, [], [], [], 0, 0  # used: end of the packed payload
        count = 0
        for name, tensor in pairs:
            spec = self._check(count, name, tensor)
            count += 1
            raw = _bytes_of(tensor)
            sends_direct = raw.numel() >= self.direct_from
            start = 0
            while True:
                rest = raw.numel() - start
                offset = 0 if sends_direct else align(used)
                if sends_direct:
                    room = self.capacity - align(used) - direct_total
                else:  # the payload is padded to ALIGN at its end
                    room = min(self.capacity - direct_total, self.packed_capacity) // ALIGN * ALIGN - offset
                if room < min(rest, ALIGN) or (room <= 0 and rest == 0):
                    yield BucketHeader(index, False, entries), packed, direct
                    index, entries, packed, direct, used, direct_total = index + 1, [], [], [], 0, 0
                    continue
                take = min(rest, room)
                entries.append(Entry(spec, start, take, offset, sends_direct))
                (direct if sends_direct else packed).append(raw[start : start + take])
                if sends_direct:
                    direct_total += take
                else:
                    used = offset + take
                start += take
                if start == raw.numel():
                    break
        if self.manifest is not None and count != len(self.manifest):
            raise ValueError(f"the input yielded {count} tensors but the manifest lists {len(self.manifest)}")
        yield BucketHeader(index, True, entries), packed, direct

    def _check(self, count: int, name: str, tensor: torch.Tensor) -> TensorSpec:
        return self.manifest[count] if self.trusted else check_pair(self.manifest, count, name, tensor)


def pairs_of(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]] | Iterable[tuple[str, torch.Tensor]]:
    """A Mapping's or a Sequence's pairs as a list; a lazy iterator as it is."""
    if isinstance(named_tensors, Mapping):
        return list(named_tensors.items())
    if isinstance(named_tensors, Sequence):
        return list(named_tensors)
    return named_tensors


def check_pair(manifest: list[TensorSpec] | None, count: int, name: str, tensor: torch.Tensor) -> TensorSpec:
    """The spec of input pair #`count`, which must be a (str, Tensor) and match the manifest's entry, if any."""
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"named_tensors must yield (str, Tensor) pairs, got ({type(name).__name__}, {type(tensor).__name__})"
        )
    spec = TensorSpec.of(name, tensor)
    if manifest is not None and (count >= len(manifest) or manifest[count] != spec):
        expected = manifest[count] if count < len(manifest) else "nothing more"
        raise ValueError(f"tensor #{count} {spec} does not match the manifest ({expected})")
    return spec


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (a contiguous copy first if it is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)

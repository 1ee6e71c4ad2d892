"""The wire format: a transfer header, then buckets, then every rank's verdict.

Transfer header (its length as one int64, then the bytes): JSON with the protocol version, the transfer's version
number, its kind ("weights" or "adapter"), the bucket size, whether buckets carry checksums, and the manifest (every
tensor's name, dtype and shape, when the sender knows it up front) — so a receiver can validate the whole transfer
before it applies a single byte.

Each bucket is up to four kinds of broadcast, in order:
  control   64 KiB: the header's length, the packed payload's length (8-byte little-endian each), then the header
            — JSON: index, last, abort notice, checksums, and the entries in the order sent, each a tensor or a byte
            range of one, either packed (with its offset in the payload, aligned to 64) or direct
  overflow  only for a header longer than the control message holds: the rest of it
  payload   the packed small tensors, exactly as long as announced (nothing when no tensor was packed)
  direct    one broadcast per direct entry, in order: a byte range of a large tensor sent from the tensor's own memory
            and received straight into its destination — no packing copy on either side
A bucket carries at most `bucket_bytes` in all (payload plus direct entries).
The transfer ends with an all-reduce (MAX) of every rank's failure flag, so the sender learns whether all applied it.
"""

import enum
import json
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

PROTOCOL_VERSION = 2  # 2: the header's coverage
ALIGN = 64
CONTROL_BYTES = 64 << 10
INLINE_HEADER_BYTES = CONTROL_BYTES - 16

DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


class TransferError(RuntimeError):
    """A transfer failed part-way (peer died or stalled, sender aborted, corrupted bucket): nothing was completed."""


class ProtocolError(TransferError):
    """The other side speaks another protocol version, or sent metadata that does not add up."""


NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return NAMES[dtype]
    except KeyError:
        raise TypeError(f"lorarl.weight_sync cannot send tensors of dtype {dtype}") from None


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class TensorSpec(NamedTuple):
    """A tensor's name, dtype (as named in DTYPES) and shape: what a manifest lists (a tuple: cheap by the 10,000)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))

    @classmethod
    def coerce(cls, spec: "TensorSpec | tuple") -> "TensorSpec":
        """A `TensorSpec`, or one made from a `(name, shape, torch.dtype)` tuple."""
        if isinstance(spec, cls):
            return spec
        name, shape, dtype = spec
        return cls(name, dtype_name(dtype), tuple(int(size) for size in shape))


class Entry(NamedTuple):
    """Bytes `[start, start + length)` of tensor `spec`: at `offset` in the bucket's payload, or `direct`."""

    spec: TensorSpec
    start: int
    length: int
    offset: int = 0
    direct: bool = False

    @property
    def completes(self) -> bool:
        return self.start + self.length == self.spec.nbytes

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.completes


@dataclass
class TransferHeader:
    version: int
    kind: str
    bucket_bytes: int
    verify: bool
    manifest: list[TensorSpec] | None = None
    adapter_config: dict | None = None
    coverage: str = "full"  # `full`: every weight of the receiver's model; `subset`: some (the others kept)
    protocol: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        body = {
            "protocol": self.protocol,
            "version": self.version,
            "kind": self.kind,
            "bucket_bytes": self.bucket_bytes,
            "verify": self.verify,
            "manifest": None if self.manifest is None else [[s.name, s.dtype, s.shape] for s in self.manifest],
            "adapter_config": self.adapter_config,
            "coverage": self.coverage,
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "TransferHeader":
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProtocolError(f"unreadable transfer header ({e})") from None
        if not isinstance(data, dict) or data.get("protocol") != PROTOCOL_VERSION:
            got = data.get("protocol") if isinstance(data, dict) else data
            raise ProtocolError(f"sender speaks weight-sync protocol {got!r}, this receiver {PROTOCOL_VERSION}")
        manifest = data.get("manifest")
        if manifest is not None:
            data["manifest"] = [_spec(s) for s in manifest]
        return cls(**data)


@dataclass
class BucketHeader:
    index: int
    last: bool
    entries: list[Entry] = field(default_factory=list)  # in the order sent: packed into the payload, or direct
    checksums: list[list[int]] | None = None  # the payload's, then each direct entry's
    abort: str | None = None

    @property
    def packed(self) -> list[Entry]:
        return [e for e in self.entries if not e.direct]

    @property
    def direct(self) -> list[Entry]:
        return [e for e in self.entries if e.direct]

    @property
    def payload_bytes(self) -> int:
        return align(max((e.offset + e.length for e in self.packed), default=0))

    def encode(self) -> bytes:
        rows = [
            [e.spec.name, e.spec.dtype, list(e.spec.shape), e.start, e.length, e.offset, e.direct] for e in self.entries
        ]
        body = {
            "index": self.index,
            "last": self.last,
            "entries": rows,
            "checksums": self.checksums,
            "abort": self.abort,
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes, payload_bytes: int, bucket_bytes: int) -> "BucketHeader":
        """Parse and check a bucket header against the payload length its control message announced."""
        try:
            data = json.loads(raw)
            entries = [
                Entry(TensorSpec(name, dtype, tuple(shape)), start, size, offset, bool(direct))
                for name, dtype, shape, start, size, offset, direct in data["entries"]
            ]
            header = cls(data["index"], data["last"], entries, data.get("checksums"), data.get("abort"))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise ProtocolError(f"unreadable bucket header ({e})") from None
        if payload_bytes != header.payload_bytes:
            raise ProtocolError(f"bucket {header.index}: payload length {payload_bytes} does not match its entries")
        if payload_bytes + sum(e.length for e in header.direct) > bucket_bytes:
            raise ProtocolError(f"bucket {header.index} carries more than bucket_bytes={bucket_bytes}")
        for e in header.entries:
            empty_ok = e.length == 0 and e.spec.nbytes == 0
            bad_range = e.start < 0 or (e.length <= 0 and not empty_ok) or e.start + e.length > e.spec.nbytes
            if e.spec.dtype not in DTYPES or bad_range or e.offset < 0:
                raise ProtocolError(f"bucket {header.index}: bad entry for {e.spec.name!r}")
        return header


def checksum(payload: torch.Tensor, chunk: int = 1 << 24) -> list[int]:
    """Fletcher-style sums over the payload's 32-bit words (on its own device; not cryptographic): detects flipped,
    lost and reordered bytes."""
    usable = payload.numel() // 4 * 4
    words = payload[:usable].view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=payload.device)
    weighted = torch.zeros((), dtype=torch.int64, device=payload.device)
    for start in range(0, words.numel(), chunk):
        part = words[start : start + chunk].to(torch.int64)
        total += part.sum()
        weighted += (part * torch.arange(start + 1, start + 1 + part.numel(), device=payload.device)).sum()
    tail = payload[usable:].to(torch.int64).sum()
    return [int(total), int(weighted), int(tail)]


def _spec(raw: object) -> TensorSpec:
    try:
        name, dtype, shape = raw
    except (TypeError, ValueError):
        raise ProtocolError(f"bad manifest entry {raw!r}") from None
    if dtype not in DTYPES:
        raise ProtocolError(f"manifest entry {name!r} has unknown dtype {dtype!r}")
    return TensorSpec(name, dtype, tuple(shape))


def jsonable(value):
    """A peft config dict as plain JSON data: sets as sorted lists, enums as their values."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(jsonable(v) for v in value)
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    return value

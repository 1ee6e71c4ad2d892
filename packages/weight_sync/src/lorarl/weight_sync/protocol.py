"""The wire format: a transfer header, then fixed-size buckets that describe themselves.

Transfer header (two broadcasts: its length as one int64, then the bytes): JSON with the protocol version, the
transfer's version number, its kind ("weights" or "adapter"), the bucket size, whether buckets carry checksums, and
the manifest (every tensor's name, dtype and shape, when the sender knows it up front) — so a receiver can validate
the whole transfer before it applies a single byte.

Bucket (one broadcast of exactly `bucket_bytes`): `[8-byte little-endian header length][header JSON][pad][payload]`;
the header says where its payload starts. It lists its entries — a tensor, or a byte range of one when it is split
across buckets — with byte offsets into the payload (aligned to 64), and says whether it is the last bucket, or that
the sender aborted.
"""

import json
from dataclasses import asdict, dataclass, field

import torch

PROTOCOL_VERSION = 1
ALIGN = 64
LENGTH_BYTES = 8

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


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"lorarl.weight_sync cannot send tensors of dtype {dtype}")
    return name


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * DTYPES[self.dtype].itemsize

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


@dataclass(frozen=True)
class Entry:
    """Bytes `[start, start + length)` of tensor `spec`, at `offset` in the bucket's payload."""

    spec: TensorSpec
    start: int
    length: int
    offset: int

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
    protocol: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

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
    payload_offset: int = 0
    entries: list[Entry] = field(default_factory=list)
    checksum: list[int] | None = None
    abort: str | None = None

    def encode(self) -> bytes:
        entries = [[e.spec.name, e.spec.dtype, list(e.spec.shape), e.start, e.length, e.offset] for e in self.entries]
        body = {
            "index": self.index,
            "last": self.last,
            "payload_offset": self.payload_offset,
            "entries": entries,
            "checksum": self.checksum,
            "abort": self.abort,
        }
        return json.dumps(body).encode()

    @staticmethod
    def size_bound(entries: list[Entry]) -> int:
        """An upper bound of the encoded size with these entries (checksums and numbers at full width)."""
        return 256 + sum(len(json.dumps([e.spec.name, e.spec.dtype, list(e.spec.shape)])) + 64 for e in entries)

    @classmethod
    def decode(cls, bucket: torch.Tensor) -> "BucketHeader":
        """Read and check the header at the start of a received bucket (any device)."""
        capacity = bucket.numel()
        head = bucket[:LENGTH_BYTES].cpu()
        length = int.from_bytes(bytes(head.tolist()), "little")
        if not 0 < length <= capacity - LENGTH_BYTES:
            raise ProtocolError(f"bucket header length {length} does not fit a bucket of {capacity} bytes")
        raw = bytes(bucket[LENGTH_BYTES : LENGTH_BYTES + length].cpu().numpy().tobytes())
        try:
            data = json.loads(raw)
            entries = [
                Entry(TensorSpec(n, d, tuple(s)), start, size, off) for n, d, s, start, size, off in data["entries"]
            ]
            header = cls(
                data["index"], data["last"], data["payload_offset"], entries, data.get("checksum"), data.get("abort")
            )
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise ProtocolError(f"unreadable bucket header ({e})") from None
        if header.entries and not LENGTH_BYTES + length <= header.payload_offset <= capacity:
            raise ProtocolError(f"bucket {header.index}: payload offset {header.payload_offset} out of range")
        payload = capacity - header.payload_offset
        for e in header.entries:
            empty_ok = e.length == 0 and e.spec.nbytes == 0
            bad_range = e.start < 0 or (e.length <= 0 and not empty_ok) or e.start + e.length > e.spec.nbytes
            if e.spec.dtype not in DTYPES or bad_range:
                raise ProtocolError(f"bucket {header.index}: bad entry for {e.spec.name!r}")
            if e.offset < 0 or e.offset + e.length > payload:
                raise ProtocolError(f"bucket {header.index}: entry {e.spec.name!r} lies outside the payload")
        return header


def payload_start(header_bound: int) -> int:
    return align(LENGTH_BYTES + header_bound)


def write_header(bucket: torch.Tensor, header: BucketHeader) -> None:
    """Write `header` at the start of `bucket` (any device), before its payload."""
    raw = header.encode()
    if LENGTH_BYTES + len(raw) > header.payload_offset and header.entries:
        raise ProtocolError(f"bucket header of {len(raw)} bytes overruns its payload at {header.payload_offset}")
    prefix = torch.frombuffer(bytearray(len(raw).to_bytes(LENGTH_BYTES, "little") + raw), dtype=torch.uint8)
    bucket[: prefix.numel()].copy_(prefix, non_blocking=False)


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
        name, dtype, shape = raw["name"], raw["dtype"], raw["shape"]
    except (TypeError, KeyError):
        raise ProtocolError(f"bad manifest entry {raw!r}") from None
    if dtype not in DTYPES:
        raise ProtocolError(f"manifest entry {name!r} has unknown dtype {dtype!r}")
    return TensorSpec(name, dtype, tuple(shape))

"""`BucketReceiver`: receive a transfer from `BucketSender` and apply it, never half-way without saying so.

The receiver posts the broadcast of bucket k+1 into its second buffer while the consumer handles bucket k.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lorarl.weight_sync.protocol import (
    DTYPES,
    BucketHeader,
    ProtocolError,
    TensorSpec,
    TransferError,
    TransferHeader,
    align,
    checksum,
)
from lorarl.weight_sync.transport import Channel


class PartialLoadError(TransferError):
    """The transfer failed after some tensors were already written into the target; `applied` names them."""

    def __init__(self, message: str, applied: list[str]):
        super().__init__(
            f"{message}; the target is partially updated ({len(applied)} tensors already applied: "
            f"{', '.join(applied[:8])}{', …' if len(applied) > 8 else ''})"
        )
        self.applied = applied


@dataclass
class _Transfer:
    """A receive in progress: its header, where the bucket stream stands, the split tensor being reassembled."""

    header: TransferHeader
    next_index: int = 0  # the bucket to receive next
    pending: dist.Work | None = None  # its broadcast, already posted
    finished: bool = False  # the last bucket (or the sender's abort notice) has arrived
    received: int = 0  # tensors completed
    split: tuple[TensorSpec, int] | None = None  # tensor being received in parts, and its next byte
    manifest_index: dict[str, TensorSpec] = field(default_factory=dict)


class BucketReceiver:
    """A receiving rank of `group` (the sender is rank `src`). `version` is the last *completed* transfer's."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        src: int = 0,
        device: torch.device | str | None = None,
        timeout: float = 300.0,
    ):
        self.channel = Channel(group, src, device, timeout)
        if self.channel.rank == src:
            raise ValueError(f"BucketReceiver runs on ranks other than src ({src})")
        self.version: int | None = None
        self._buffers: list[torch.Tensor] = []

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the `(name, tensor)` of one transfer of weights, in the order sent.

        The tensors are **views into a reused bucket buffer, valid only until the iterator advances** (tensors
        that were split across buckets are yielded as tensors of their own). Copy what you keep. `version` is set
        once the whole transfer has been received and validated; stopping early drains the rest and raises.
        """
        yield from self._tensors(self._start("weights"))

    def receive_adapter(self) -> tuple[dict[str, torch.Tensor], dict, int]:
        """Receive an adapter transfer: `(tensors, peft adapter config, version)`; the tensors are owned copies."""
        transfer = self._start("adapter")
        tensors = {name: tensor.clone() for name, tensor in self._tensors(transfer)}
        return tensors, transfer.header.adapter_config or {}, transfer.header.version

    def load_into(self, target: nn.Module | object, *, strict: bool = True) -> int:
        """Receive one transfer of weights into `target` and return its version.

        An `nn.Module`: each tensor is copied into the parameter or buffer of that name; unknown names, shape or
        dtype mismatches — and, with `strict`, names the transfer lacks — raise before anything is applied
        (checked against the sender's manifest). Any other object must have vLLM's `load_weights(iterable)`; it is
        given owned copies, so it may keep them. A failure part-way raises `PartialLoadError` naming what was
        already applied; the version is then not reported, and the sender learns of the failure.
        """
        transfer = self._start("weights")
        if isinstance(target, nn.Module):
            return self._load_module(transfer, target, strict)
        if not callable(getattr(target, "load_weights", None)):
            self._fail(transfer, TypeError("target must be an nn.Module or have a load_weights(iterable) method"))
        applied: list[str] = []

        def owned_copies() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self._tensors(transfer, finish=False):
                applied.append(name)
                yield name, tensor.clone()

        try:
            target.load_weights(owned_copies())
            self._finish(transfer)
        except TransferError as e:
            raise PartialLoadError(str(e), applied) from e
        except Exception as e:
            self._fail(transfer, e, applied)
        return transfer.header.version

    # --- the transfer itself -----------------------------------------------------------------------------------

    def _start(self, kind: str) -> _Transfer:
        raw = self.channel.broadcast_bytes(None, "transfer header")
        header = TransferHeader.decode(raw)
        transfer = _Transfer(header)
        if header.manifest is not None:
            transfer.manifest_index = {spec.name: spec for spec in header.manifest}
        if header.kind != kind:
            self._fail(transfer, ProtocolError(f"expected a {kind!r} transfer, the sender sent {header.kind!r}"))
        if len(self._buffers) != 2 or self._buffers[0].numel() != header.bucket_bytes:
            self._buffers = [
                torch.empty(header.bucket_bytes, dtype=torch.uint8, device=self.channel.device) for _ in range(2)
            ]
        return transfer

    def _buckets(self, transfer: _Transfer) -> Iterator[tuple[BucketHeader, torch.Tensor]]:
        """Each bucket's checked header and buffer; the next bucket is already on its way while one is handled."""
        while not transfer.finished:
            yield self._next_bucket(transfer, check=True)

    def _next_bucket(self, transfer: _Transfer, *, check: bool) -> tuple[BucketHeader, torch.Tensor]:
        """Receive the next bucket and post the one after it (before checking, so a failed check can still drain)."""
        version, index = transfer.header.version, transfer.next_index
        if transfer.pending is None:
            transfer.pending = self.channel.broadcast(self._buffers[index % 2])
        self.channel.wait(transfer.pending, f"version {version}: bucket {index}")
        transfer.pending = None
        buffer = self._buffers[index % 2]
        try:
            bucket = BucketHeader.decode(buffer)
            if bucket.index != index:
                raise ProtocolError(f"version {version}: expected bucket {index}, got {bucket.index}")
        except ProtocolError:
            transfer.finished = True  # the stream cannot be followed any further
            raise
        transfer.finished = bucket.last or bucket.abort is not None
        transfer.next_index += 1
        if not transfer.finished:
            transfer.pending = self.channel.broadcast(self._buffers[transfer.next_index % 2])
        if check:
            if bucket.abort is not None:
                raise TransferError(f"version {version}: the sender aborted: {bucket.abort}")
            self._check_bucket(transfer, bucket, buffer)
        return bucket, buffer

    def _check_bucket(self, transfer: _Transfer, bucket: BucketHeader, buffer: torch.Tensor) -> None:
        header = transfer.header
        if header.verify:
            used = align(max((e.offset + e.length for e in bucket.entries), default=0))
            got = checksum(buffer[bucket.payload_offset : bucket.payload_offset + used])
            if got != bucket.checksum:
                raise TransferError(f"version {header.version}: bucket {bucket.index} is corrupted (checksum)")
        for entry in bucket.entries:
            spec = entry.spec
            if transfer.manifest_index and transfer.manifest_index.get(spec.name) != spec:
                raise ProtocolError(f"version {header.version}: {spec.name!r} ({spec}) is not in the manifest as sent")
            if transfer.split is not None:
                expected, next_byte = transfer.split
                if spec != expected or entry.start != next_byte:
                    raise ProtocolError(f"version {header.version}: split tensor {expected.name!r} interrupted")
            elif entry.start != 0:
                raise ProtocolError(f"version {header.version}: {spec.name!r} starts mid-tensor")
            transfer.split = None if entry.completes else (spec, entry.start + entry.length)
            transfer.received += entry.completes

    def _tensors(self, transfer: _Transfer, *, finish: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The transfer's tensors: views into the bucket for whole ones, reassembled copies for split ones."""
        done = False
        try:
            assembling: torch.Tensor | None = None
            for bucket, buffer in self._buckets(transfer):
                payload = buffer[bucket.payload_offset :]
                for entry in bucket.entries:
                    data = payload[entry.offset : entry.offset + entry.length]
                    if entry.whole:
                        yield entry.spec.name, _as_tensor(data, entry.spec)
                        continue
                    if entry.start == 0:
                        assembling = torch.empty(entry.spec.nbytes, dtype=torch.uint8, device=buffer.device)
                    assembling[entry.start : entry.start + entry.length].copy_(data)
                    if entry.completes:
                        yield entry.spec.name, _as_tensor(assembling, entry.spec)
                        assembling = None
            done = True
        finally:
            if not done:
                self._abandon(transfer)
        if finish:
            self._finish(transfer)

    def _finish(self, transfer: _Transfer) -> None:
        header = transfer.header
        if header.manifest is not None and transfer.received != len(header.manifest):
            self._fail(
                transfer,
                ProtocolError(
                    f"version {header.version}: got {transfer.received} tensors, "
                    f"the manifest lists {len(header.manifest)}"
                ),
                drained=True,
            )
        if self.channel.agree_failed(False, f"version {header.version}: status"):
            raise TransferError(f"version {header.version}: another rank failed it")
        self.version = header.version

    def _abandon(self, transfer: _Transfer) -> None:
        """The consumer stopped or failed mid-transfer: receive the rest so the sender is not left hanging, and
        report failure to every rank. Errors of a broken connection are left to the caller's exception."""
        try:
            while not transfer.finished:
                self._next_bucket(transfer, check=False)
            self.channel.agree_failed(True, f"version {transfer.header.version}: status")
        except TransferError:
            pass

    def _fail(self, transfer: _Transfer, error: Exception, applied: list[str] | None = None, drained: bool = False):
        if not drained:
            self._abandon(transfer)
        else:
            self.channel.agree_failed(True, f"version {transfer.header.version}: status")
        if applied:
            raise PartialLoadError(
                f"version {transfer.header.version}: {type(error).__name__}: {error}", applied
            ) from error
        raise error

    # --- into an nn.Module ---------------------------------------------------------------------------------------

    def _load_module(self, transfer: _Transfer, module: nn.Module, strict: bool) -> int:
        header = transfer.header
        targets = dict(module.state_dict(keep_vars=True))
        if header.manifest is None:
            self._fail(
                transfer,
                ProtocolError(
                    f"version {header.version}: loading into a module needs the "
                    "sender's manifest (pass manifest= for a lazy iterator)"
                ),
            )
        problems = _mismatches(header.manifest, targets, strict)
        if problems:
            self._fail(
                transfer,
                ValueError(
                    f"version {header.version} does not fit the target, nothing applied: " + "; ".join(problems)
                ),
            )
        applied: list[str] = []
        try:
            with torch.no_grad():
                for name, tensor in self._tensors(transfer, finish=False):
                    targets[name].copy_(tensor)
                    applied.append(name)
            self._finish(transfer)
        except TransferError as e:
            raise PartialLoadError(str(e), applied) from e
        return header.version


def _as_tensor(data: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    dtype = DTYPES[spec.dtype]
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype, device=data.device)
    return data.view(dtype).view(spec.shape)


def _mismatches(manifest: list[TensorSpec], targets: dict[str, torch.Tensor], strict: bool) -> list[str]:
    problems = []
    sent = set()
    for spec in manifest:
        sent.add(spec.name)
        target = targets.get(spec.name)
        if target is None:
            problems.append(f"unknown name {spec.name!r}")
        elif tuple(target.shape) != spec.shape or target.dtype != DTYPES[spec.dtype]:
            problems.append(
                f"{spec.name!r}: sent {spec.dtype}{list(spec.shape)}, target has "
                f"{str(target.dtype).removeprefix('torch.')}{list(target.shape)}"
            )
    if strict:
        problems += [f"missing {name!r}" for name in targets if name not in sent]
    return problems

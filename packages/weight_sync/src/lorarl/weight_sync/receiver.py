"""`BucketReceiver`: receive a transfer from `BucketSender` and apply it, never half-way without saying so.

The control message of bucket k+1 is already posted while the consumer handles bucket k; large tensors sent direct
land straight in their destination (a buffer reused from transfer to transfer, a tensor of their own for a caller
that keeps them, or the target parameter itself for `load_into`).
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lorarl.weight_sync.gc_pause import gc_paused
from lorarl.weight_sync.protocol import (
    CONTROL_BYTES,
    DTYPES,
    INLINE_HEADER_BYTES,
    BucketHeader,
    Entry,
    ProtocolError,
    TensorSpec,
    TransferError,
    TransferHeader,
    checksum,
)
from lorarl.weight_sync.transport import Collectives

MAX_HEADER_BYTES = 256 << 20
VIEW, OWNED, LANDED = "view", "owned", "landed"  # what a received tensor is (see _tensors)
Destination = Callable[[Entry], torch.Tensor]  # where a direct entry's bytes land: a uint8 view of entry.length


class PartialLoadError(TransferError):
    """The transfer failed after some tensors were already written into the target; `applied` names them."""

    def __init__(self, message: str, applied: list[str]):
        super().__init__(
            f"{message}; the target is partially updated ({len(applied)} tensors already applied: "
            f"{', '.join(applied[:8])}{', …' if len(applied) > 8 else ''})"
        )
        self.applied = applied


@dataclass
class _Posted:
    """A bucket whose receives are posted: its header, where its payload and direct entries land, their broadcasts."""

    bucket: BucketHeader
    payload: torch.Tensor
    direct: list[torch.Tensor]
    works: list[dist.Work]
    error: ProtocolError | None  # its entries do not match the manifest: received into scratch, to be raised


@dataclass
class _Transfer:
    """A receive in progress: its header, where the bucket stream stands, tensors being reassembled."""

    header: TransferHeader
    destination: Destination | None = None  # None: direct entries land in tensors of their own
    next_index: int = 0  # the bucket to receive next
    control: torch.Tensor | None = None  # its control message, already posted ...
    pending: dist.Work | None = None  # ... by this broadcast
    ahead: _Posted | None = None  # the bucket after the one being completed, its receives already posted
    finished: bool = False  # the last bucket's (or the sender's abort notice's) receives are posted
    received: int = 0  # tensors completed
    split: tuple[TensorSpec, int] | None = None  # tensor being received in parts, and its next byte
    reuse: bool = False  # large tensors land in the receiver's reused buffers (the consumer copies what it keeps)
    assembling: dict[str, torch.Tensor] = field(default_factory=dict)  # bytes of tensors received in parts
    manifest_index: dict[str, TensorSpec] = field(default_factory=dict)

    @property
    def exhausted(self) -> bool:
        """Every bucket has been received."""
        return self.finished and self.ahead is None


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
        self.wire = Collectives(group, src, device, timeout)
        if self.wire.rank == src:
            raise ValueError(f"BucketReceiver runs on ranks other than src ({src})")
        self.version: int | None = None
        self.coverage = "full"  # what the transfer received last said it covers (`Update.coverage`)
        self._scratch: list[torch.Tensor | None] = [None, None]  # packed payloads being received (two buckets)
        # buffers of large tensors by size, free to land the next ones in: reused memory is already mapped, where a
        # fresh tensor per entry paid its page faults on every transfer
        self._free: dict[int, list[torch.Tensor]] = {}

    def receive(self, *, keep: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the `(name, tensor)` of one transfer of weights, in the order sent.

        Without `keep`, every tensor is **valid only until the iterator advances**: small ones are views into a
        reused bucket buffer, large ones (sent direct, or split) land in buffers reused from tensor to tensor and
        transfer to transfer — copy what you keep (vLLM's `load_weights` does). With `keep`, each is a tensor of its
        own (large ones received straight into it), for a caller that holds the whole transfer. `version` is set
        once the whole transfer has been received and validated; stopping early drains the rest and reports failure.
        """
        transfer = self._start("weights")
        transfer.reuse = not keep
        for name, tensor, kind in self._tensors(transfer):
            yield name, tensor.clone() if keep and kind == VIEW else tensor

    @gc_paused()
    def receive_adapter(self) -> tuple[dict[str, torch.Tensor], dict, int]:
        """Receive an adapter transfer: `(tensors, peft adapter config, version)`; the tensors are the caller's own
        (large ones received straight into them: no buffer of this receiver outlives the transfer — the first factor
        set brings a model's worth of base weights, once)."""
        transfer = self._start("adapter")
        tensors = {name: tensor.clone() if kind == VIEW else tensor for name, tensor, kind in self._tensors(transfer)}
        return tensors, transfer.header.adapter_config or {}, transfer.header.version

    @gc_paused()
    def load_into(self, target: nn.Module | object, *, strict: bool | None = None) -> int:
        """Receive one transfer of weights into `target` and return its version.

        A target with vLLM's `load_weights(iterable)` (a vLLM model: it maps checkpoint names onto its fused,
        sharded parameters) is given owned tensors, so it may keep them. Any other `nn.Module`: each tensor is copied
        into the parameter or buffer of that name (large ones are received straight into it); unknown names, shape or
        dtype mismatches — and, with `strict` (by default: when the sender announced a full update), names the
        transfer lacks — raise before anything is applied (checked against the sender's manifest). A failure
        part-way raises `PartialLoadError` naming what was already applied; the version is then not reported, and the
        sender learns of the failure.
        """
        transfer = self._start("weights")
        if not callable(getattr(target, "load_weights", None)):
            if isinstance(target, nn.Module):
                return self._load_module(transfer, target, transfer.header.coverage == "full" if strict is None
                                         else strict)  # fmt: skip
            self._fail(transfer, TypeError("target must be an nn.Module or have a load_weights(iterable) method"))
        applied: list[str] = []

        def owned() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor, kind in self._tensors(transfer, finish=False):
                applied.append(name)
                yield name, tensor.clone() if kind == VIEW else tensor

        try:
            target.load_weights(owned())
        except TransferError as e:
            raise PartialLoadError(str(e), applied) from e
        except Exception as e:
            self._fail(transfer, e, applied)
        self._finish(transfer)
        return transfer.header.version

    # --- the transfer itself -----------------------------------------------------------------------------------

    @gc_paused()
    def _start(self, kind: str) -> _Transfer:
        raw = self.wire.broadcast_bytes(None, "transfer header")
        header = TransferHeader.decode(raw)
        self.coverage = header.coverage
        transfer = _Transfer(header)
        if header.manifest is not None:
            transfer.manifest_index = {spec.name: spec for spec in header.manifest}
        if header.kind != kind:
            self._fail(transfer, ProtocolError(f"expected a {kind!r} transfer, the sender sent {header.kind!r}"))
        return transfer

    def _payload(self, size: int, index: int) -> torch.Tensor:
        """A receive buffer of at least `size` bytes for bucket `index`, reused from transfer to transfer (grown when
        needed); consecutive buckets get different ones, as both may be in flight."""
        slot = index % 2
        if self._scratch[slot] is None or self._scratch[slot].numel() < size:
            self._scratch[slot] = torch.empty(size, dtype=torch.uint8, device=self.wire.device)
        return self._scratch[slot][:size]

    def _post_control(self, transfer: _Transfer) -> None:
        transfer.control = torch.empty(CONTROL_BYTES, dtype=torch.uint8, device=self.wire.device)
        transfer.pending = self.wire.broadcast(transfer.control)

    def _next_bucket(
        self, transfer: _Transfer, *, check: bool
    ) -> tuple[BucketHeader, torch.Tensor, list[torch.Tensor]]:
        """Receive the next bucket: its header, packed payload and direct entries (already in their destinations).
        The receives of the bucket after it are posted before this one's data is waited for, so the sender never
        waits for this side between buckets; the control message after that is posted too, so a failed check can
        still drain."""
        posted = transfer.ahead or self._post_bucket(transfer, check)
        transfer.ahead = None
        if not transfer.finished:
            transfer.ahead = self._post_bucket(transfer, check)
        bucket, payload, direct = posted.bucket, posted.payload, posted.direct
        what = f"version {transfer.header.version}: bucket {bucket.index}"
        for work in posted.works:
            self.wire.wait(work, what)
        if check:
            if posted.error is not None:
                raise posted.error
            if bucket.abort is not None:
                raise TransferError(f"version {transfer.header.version}: the sender aborted: {bucket.abort}")
            if transfer.header.verify and bucket.checksums != [checksum(payload), *(checksum(p) for p in direct)]:
                raise TransferError(f"{what} is corrupted (checksum)")
            self._check_entries(transfer, bucket)
        return bucket, payload, direct

    @gc_paused()
    def _post_bucket(self, transfer: _Transfer, check: bool) -> _Posted:
        """Wait for the next bucket's control message, check its header, post the receives of its payload and
        direct entries, then post the following control message."""
        version, index, bucket_bytes = transfer.header.version, transfer.next_index, transfer.header.bucket_bytes
        if transfer.pending is None:
            self._post_control(transfer)
        what = f"version {version}: bucket {index}"
        self.wire.wait(transfer.pending, what)
        transfer.pending = None
        control = transfer.control.cpu().numpy().tobytes()
        header_bytes, payload_bytes = int.from_bytes(control[:8], "little"), int.from_bytes(control[8:16], "little")
        try:
            if not 0 < header_bytes <= MAX_HEADER_BYTES:
                raise ProtocolError(f"{what}: header length {header_bytes} out of range")
            raw = control[16 : 16 + min(header_bytes, INLINE_HEADER_BYTES)]
            if header_bytes > INLINE_HEADER_BYTES:
                overflow = torch.empty(header_bytes - INLINE_HEADER_BYTES, dtype=torch.uint8, device=self.wire.device)
                self.wire.wait(self.wire.broadcast(overflow), what)
                raw += overflow.cpu().numpy().tobytes()
            bucket = BucketHeader.decode(raw, payload_bytes, bucket_bytes)
            if bucket.index != index:
                raise ProtocolError(f"version {version}: expected bucket {index}, got {bucket.index}")
        except ProtocolError:
            transfer.finished = True  # the stream cannot be followed any further
            raise
        error = None
        for entry in bucket.entries:  # checked before any of its bytes land in a destination
            if transfer.manifest_index and transfer.manifest_index.get(entry.spec.name) != entry.spec:
                error = ProtocolError(f"{what}: {entry.spec.name!r} ({entry.spec}) is not in the manifest as sent")
        payload = self._payload(payload_bytes, index)
        works = [self.wire.broadcast(payload)] if payload_bytes else []
        direct = [self._landing(transfer, entry, check and error is None) for entry in bucket.direct]
        works += [self.wire.broadcast(part) for part in direct if part.numel()]
        transfer.finished = bucket.last or bucket.abort is not None
        transfer.next_index += 1
        if not transfer.finished:
            self._post_control(transfer)
        return _Posted(bucket, payload, direct, works, error)

    def _landing(self, transfer: _Transfer, entry: Entry, check: bool) -> torch.Tensor:
        """Where a direct entry's bytes are received: the consumer's destination, or a tensor being assembled."""
        if not check:  # draining: the bytes are thrown away
            return self._payload(entry.length, transfer.next_index)
        if transfer.destination is not None:
            landed = transfer.destination(entry)
            if landed is not None:
                return landed
        if entry.start == 0:
            transfer.assembling[entry.spec.name] = self._assembly(transfer, entry.spec.nbytes)
        assembly = transfer.assembling.get(entry.spec.name)
        if assembly is None:
            raise ProtocolError(f"version {transfer.header.version}: {entry.spec.name!r} continues without a start")
        return assembly[entry.start : entry.start + entry.length]

    def _assembly(self, transfer: _Transfer, nbytes: int) -> torch.Tensor:
        """Where a large tensor's bytes go: a free buffer of its size (`transfer.reuse`), else a new one."""
        free = self._free.get(nbytes) if transfer.reuse else None
        return free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, device=self.wire.device)

    def _release(self, transfer: _Transfer, assembly: torch.Tensor) -> None:
        """The consumer has moved past the tensor in `assembly`: its buffer is free for the next one of its size."""
        if transfer.reuse:
            self._free.setdefault(assembly.numel(), []).append(assembly)

    def _check_entries(self, transfer: _Transfer, bucket: BucketHeader) -> None:
        version = transfer.header.version
        for entry in bucket.entries:
            spec = entry.spec
            if transfer.split is not None:
                expected, next_byte = transfer.split
                if spec != expected or entry.start != next_byte:
                    raise ProtocolError(f"version {version}: split tensor {expected.name!r} interrupted")
            elif entry.start != 0:
                raise ProtocolError(f"version {version}: {spec.name!r} starts mid-tensor")
            transfer.split = None if entry.completes else (spec, entry.start + entry.length)
            transfer.received += entry.completes

    def _tensors(self, transfer: _Transfer, *, finish: bool = True) -> Iterator[tuple[str, torch.Tensor | None, str]]:
        """`(name, tensor, kind)` of the transfer, in order. kind VIEW: a view into the reused bucket buffer (whole
        packed tensors); OWNED: a tensor of its own (reassembled, or received direct); LANDED: received straight into
        the consumer's destination (tensor None)."""
        done = False
        try:
            while not transfer.exhausted:
                bucket, payload, _ = self._next_bucket(transfer, check=True)
                for entry in bucket.entries:
                    if entry.direct:
                        if entry.completes:
                            assembly = transfer.assembling.pop(entry.spec.name, None)
                            if assembly is not None:
                                yield entry.spec.name, _as_tensor(assembly, entry.spec), OWNED
                                self._release(transfer, assembly)
                            else:
                                yield entry.spec.name, None, LANDED
                        continue
                    data = payload[entry.offset : entry.offset + entry.length]
                    if entry.whole:
                        yield entry.spec.name, _as_tensor(data, entry.spec), VIEW
                        continue
                    if entry.start == 0:
                        transfer.assembling[entry.spec.name] = self._assembly(transfer, entry.spec.nbytes)
                    transfer.assembling[entry.spec.name][entry.start : entry.start + entry.length].copy_(data)
                    if entry.completes:
                        assembly = transfer.assembling.pop(entry.spec.name)
                        yield entry.spec.name, _as_tensor(assembly, entry.spec), OWNED
                        self._release(transfer, assembly)
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
        if self.wire.agree_failed(False, f"version {header.version}: status"):
            raise TransferError(f"version {header.version}: another rank failed it")
        self.version = header.version

    def _abandon(self, transfer: _Transfer) -> None:
        """The consumer stopped or failed mid-transfer: receive the rest so the sender is not left hanging, and
        report failure to every rank. Errors of a broken connection are left to the caller's exception."""
        try:
            while not transfer.exhausted:
                self._next_bucket(transfer, check=False)
            self.wire.agree_failed(True, f"version {transfer.header.version}: status")
        except TransferError:
            pass

    def _fail(self, transfer: _Transfer, error: Exception, applied: list[str] | None = None, drained: bool = False):
        if not drained:
            self._abandon(transfer)
        else:
            self.wire.agree_failed(True, f"version {transfer.header.version}: status")
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
        touched: list[str] = []

        def into_the_parameter(entry: Entry) -> torch.Tensor | None:
            target = targets[entry.spec.name]
            if not target.is_contiguous() or target.device != self.wire.device:
                return None
            if target.dtype != DTYPES[entry.spec.dtype]:
                return None  # received beside it, then cast as it is copied
            if entry.start == 0:
                touched.append(entry.spec.name)  # its bytes start changing now
            return target.detach().reshape(-1).view(torch.uint8)[entry.start : entry.start + entry.length]

        transfer.destination = into_the_parameter
        try:
            with torch.no_grad():
                for name, tensor, kind in self._tensors(transfer, finish=False):
                    if kind != LANDED:
                        targets[name].copy_(tensor)
                        touched.append(name)
        except TransferError as e:
            raise PartialLoadError(str(e), touched) from e
        self._finish(transfer)
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
        elif tuple(target.shape) != spec.shape or not _castable(DTYPES[spec.dtype], target.dtype):
            problems.append(
                f"{spec.name!r}: sent {spec.dtype}{list(spec.shape)}, target has "
                f"{str(target.dtype).removeprefix('torch.')}{list(target.shape)}"
            )
    if strict:
        problems += [f"missing {name!r}" for name in targets if name not in sent]
    return problems


def _castable(sent: torch.dtype, target: torch.dtype) -> bool:
    """A tensor sent as `sent` loads into a `target` tensor: the same dtype, or floating point both (cast as it is
    copied, as vLLM's loaders do: weights sent in another precision than the engine's)."""
    return sent == target or (sent.is_floating_point and target.is_floating_point)

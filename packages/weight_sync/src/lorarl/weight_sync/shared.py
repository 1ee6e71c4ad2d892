"""Same-machine delivery without a wire: shared buckets (CUDA IPC on GPU, shared memory on CPU).

For a colocated engine whose workers are other processes on the trainer's GPUs (vLLM with tensor parallelism): the
tensors stay on the trainer's GPU and the workers read them in place. Small tensors are packed into one buffer that
is reused from bucket to bucket; tensors of at least `direct_bytes` are shared from their own memory (no copy). Each
bucket is a small picklable `SharedBucket` — handles and a manifest — to hand to the workers (e.g. through
`LLM.collective_rpc`); `open_bucket` turns it back into named tensors in the worker.

The producer reuses the packed buffer for the next bucket: a consumer must be done with a bucket (its copies
finished, on GPU its stream synchronized) before the producer's iterator advances. `BucketMailbox` runs that
hand-over on a TCP store the producer hosts: it posts each bucket and waits for every consumer's acknowledgement;
each consumer takes the buckets of a transfer as one stream of owned tensors (so one `load_weights` call sees the
whole version, as vLLM's checks on tied weights need), bounded by a timeout on both sides.
"""

import contextlib
import pickle
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from lorarl.weight_sync.protocol import DTYPES, ProtocolError, TensorSpec, TransferError, align
from lorarl.weight_sync.sender import DEFAULT_BUCKET_BYTES, DEFAULT_DIRECT_BYTES, NamedTensors, check_pair, pairs_of

Handle = tuple  # a picklable way to a tensor's memory from another process: (rebuild function, its arguments)


def share_handle(tensor: torch.Tensor) -> Handle:
    """A handle any process on this machine can open, as often as it likes: CUDA IPC (torch's reduction) on GPU; on
    CPU, shared memory named by a file (torch's "file_system" sharing; its "file_descriptor" default opens once)."""
    if tensor.is_cuda:
        return reduce_tensor(tensor)
    manager, name, size = tensor.untyped_storage()._share_filename_cpu_()  # moved into shared memory if not yet
    return _open_cpu, (manager, name, size, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),
                       tensor.dtype)  # fmt: skip


def _open_cpu(manager: bytes, name: bytes, size: int, offset: int, shape: tuple, stride: tuple, dtype: torch.dtype):
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, size)
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


class SharedBucket(NamedTuple):
    """One bucket of a version: the packed buffer's handle with each packed tensor's (spec, byte offset), and the
    tensors shared from their own memory as (spec, handle). `last`: the version is complete after this bucket."""

    version: int
    index: int
    last: bool
    payload: Handle | None
    packed: list[tuple[TensorSpec, int]]
    direct: list[tuple[TensorSpec, Handle]]

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec, _ in self.packed) + sum(spec.nbytes for spec, _ in self.direct)


def share_buckets(
    named_tensors: NamedTensors,
    *,
    version: int,
    device: torch.device | str,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    direct_bytes: int = DEFAULT_DIRECT_BYTES,
    manifest: Sequence[TensorSpec | tuple] | None = None,
) -> Iterator[SharedBucket]:
    """Yield the tensors as shared buckets of at most `bucket_bytes` each (a tensor larger than that is a bucket of
    its own), the last one marked `last` — also for an empty input. Tensors of at least `direct_bytes` (at most
    `bucket_bytes`) are shared from their own memory. Tensors are checked against `manifest` when given
    (`TensorSpec`s or `(name, shape, dtype)` tuples), like `BucketSender.send`, as they come: errors surface while
    iterating (inside `BucketMailbox.post`, which then tells the consumers). The buffer lives on `device`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current GPU: compare tensors' devices to it
        device = torch.device("cuda", torch.cuda.current_device())
    specs = [TensorSpec.coerce(spec) for spec in manifest] if manifest is not None else None
    direct_bytes = min(direct_bytes, bucket_bytes)
    buffer: torch.Tensor | None = None  # allocated on first use, then reused
    index, packed, direct, used, direct_total, count = 0, [], [], 0, 0, 0
    shared: list[torch.Tensor] = []  # the tensors shared from their own memory: alive until their bucket is read

    def bucket(last: bool) -> SharedBucket:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the packing copies have landed before anyone reads
        payload = share_handle(buffer[:used]) if packed else None
        return SharedBucket(version, index, last, payload, packed, direct)

    for name, tensor in pairs_of(named_tensors):
        spec = check_pair(specs, count, name, tensor)
        count += 1
        if tensor.device != device:
            raise ValueError(f"tensor {name!r} is on {tensor.device}, the shared buckets on {device}")
        nbytes = spec.nbytes
        shares_own = nbytes >= direct_bytes
        filled = used + direct_total + nbytes if shares_own else align(used) + nbytes + direct_total
        if (used or direct_total) and filled > bucket_bytes:
            yield bucket(last=False)
            index, packed, direct, shared, used, direct_total = index + 1, [], [], [], 0, 0
        if shares_own:
            shared.append(tensor.detach().contiguous())
            direct.append((spec, share_handle(shared[-1])))
            direct_total += nbytes
        else:
            if buffer is None:
                buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
            offset = align(used)
            buffer[offset : offset + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
            packed.append((spec, offset))
            used = offset + nbytes
    if specs is not None and count != len(specs):
        raise ValueError(f"the input yielded {count} tensors but the manifest lists {len(specs)}")
    yield bucket(last=True)


def open_bucket(bucket: SharedBucket) -> list[tuple[str, torch.Tensor]]:
    """The bucket's `(name, tensor)` pairs, in the order packed then shared: **views of the producer's memory, valid
    only until it packs the next bucket** — copy what you keep (vLLM's `load_weights` copies)."""
    if not isinstance(bucket, SharedBucket):
        raise TypeError(f"bucket must be a SharedBucket, got {type(bucket).__name__}")
    tensors = []
    if bucket.packed:
        rebuild, args = bucket.payload
        payload = rebuild(*args)
        for spec, offset in bucket.packed:
            if offset < 0 or offset + spec.nbytes > payload.numel():
                raise ProtocolError(f"bucket {bucket.index}: {spec.name!r} lies outside the shared payload")
            raw = payload[offset : offset + spec.nbytes]
            tensors.append((spec.name, raw.view(DTYPES[spec.dtype]).view(spec.shape)))
    for spec, (rebuild, args) in bucket.direct:
        tensor = rebuild(*args)
        if TensorSpec.of(spec.name, tensor) != spec:
            raise ProtocolError(f"bucket {bucket.index}: shared tensor {spec} arrived as {tuple(tensor.shape)} "
                                f"{tensor.dtype}")  # fmt: skip
        tensors.append((spec.name, tensor))
    return tensors


class BucketMailbox:
    """Hands shared buckets from a producer (rank 0, which hosts the TCP store on `host:port`) to `consumers`
    processes (ranks 1..consumers), transfer after transfer (each bucket pickled: its handles are plain data). Every
    wait is bounded by `timeout`: a consumer that dies or stalls makes `post` raise, a producer that dies or aborts
    makes `receive` raise; neither hangs."""

    def __init__(self, host: str, port: int, *, rank: int, consumers: int, timeout: float = 300.0):
        if consumers < 1:
            raise ValueError(f"consumers must be >= 1, got {consumers}")
        if not 0 <= rank <= consumers:
            raise ValueError(f"rank must lie in [0, consumers] = [0, {consumers}], got {rank}")
        self.rank, self.consumers, self.timeout = rank, consumers, timeout
        self.store = dist.TCPStore(host, port, is_master=rank == 0, timeout=timedelta(seconds=timeout),
                                   wait_for_workers=False)  # fmt: skip
        self.transfers = 0  # transfers begun: both sides count them, and name their keys after them
        self.version: int | None = None  # a consumer's last complete transfer

    def post(self, buckets: Iterable[SharedBucket]) -> tuple[int, int, int]:
        """Producer: post each bucket, then wait until every consumer is done with it (before the iterator packs
        the next). Returns `(tensors, bytes, buckets)`; raises `TransferError` if a consumer failed or timed out,
        and re-raises an error of the input after telling the consumers to stop."""
        if self.rank != 0:
            raise ValueError(f"post runs on the producer (rank 0), this is rank {self.rank}")
        prefix, self.transfers = f"t{self.transfers}/", self.transfers + 1
        tensors = nbytes = done = 0
        try:
            for bucket in buckets:
                self.store.set(f"{prefix}bucket/{done}", pickle.dumps(("bucket", bucket)))
                self._wait_done(prefix, done)
                tensors += len(bucket.packed) + len(bucket.direct)
                nbytes += bucket.nbytes
                done += 1
            return tensors, nbytes, done
        except BaseException as error:
            notice = pickle.dumps(("abort", f"{type(error).__name__}: {error}"))
            with contextlib.suppress(dist.DistError):  # consumers wait for bucket `done`, or (if they took it) the next
                self.store.set(f"{prefix}bucket/{done}", notice)
                self.store.set(f"{prefix}bucket/{done + 1}", notice)
            raise

    def _wait_done(self, prefix: str, index: int) -> None:
        keys = [f"{prefix}done/{index}/{rank}" for rank in range(1, self.consumers + 1)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except dist.DistStoreError as e:
            raise TransferError(f"bucket {index}: a consumer did not finish within {self.timeout:g} s ({e})") from e
        failed = [answer.decode() for answer in map(self.store.get, keys) if answer != b"ok"]
        for key in (f"{prefix}bucket/{index}", *keys):
            self.store.delete_key(key)
        if failed:
            raise TransferError(f"bucket {index}: a consumer failed: {failed[0]}")

    def receive(self, device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
        """Consumer: yield one transfer's `(name, tensor)` pairs as tensors of their own on `device` (copied out of
        each bucket, which is then acknowledged); `version` is set once the last bucket has been taken. Stopping
        early tells the producer this consumer failed."""
        if self.rank == 0:
            raise ValueError("receive runs on a consumer (rank >= 1), this is the producer")
        device = torch.device(device)
        prefix, self.transfers = f"t{self.transfers}/", self.transfers + 1
        index, version, complete = 0, None, False
        try:
            while True:
                bucket = self._take(prefix, index)
                if bucket.index != index or (index and bucket.version != version):
                    raise ProtocolError(
                        f"expected bucket {index} of one version, got {bucket.index} of {bucket.version}"
                    )
                version = bucket.version
                owned = [(name, tensor.to(device, copy=True)) for name, tensor in open_bucket(bucket)]
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()  # copied out: the producer may reuse its memory
                self.store.set(f"{prefix}done/{index}/{self.rank}", b"ok")
                index += 1
                yield from owned
                if bucket.last:
                    self.version, complete = version, True
                    return
        finally:
            if not complete:  # the producer waits for this answer to the next bucket: say this consumer stopped
                with contextlib.suppress(dist.DistError):  # unless the producer is gone
                    self.store.set(f"{prefix}done/{index}/{self.rank}", f"consumer {self.rank} stopped".encode())

    def _take(self, prefix: str, index: int) -> SharedBucket:
        try:
            kind, content = pickle.loads(self.store.get(f"{prefix}bucket/{index}"))
        except dist.DistError as e:  # the producer is gone, or stalled past the timeout
            raise TransferError(
                f"bucket {index} did not come (producer gone or stalled {self.timeout:g} s): {e}"
            ) from e
        if kind == "abort":
            raise TransferError(f"the producer aborted the transfer: {content}")
        return content

"""lorarl's weight transfer into vLLM, through vLLM's own weight-update API (its RL API).

    llm = LLM(model=path, weight_transfer_config={"backend": "lorarl"}, ...)
    transfer = VllmWeightTransfer(OfflineClient(llm), channel="gloo", workers=1)   # every worker joins
    transfer.send(iter_merged_weights(model), version=step, manifest=merged_weight_specs(model))
    path = transfer.send_adapter(tensors, peft_config, version=step, directory=d)  # for a LoRARequest
    transfer.send_factors(factor_set(lora_factors(model), base), version=step)       # the engine merges them

The receiving side is `vllm_engine.LorarlWeightTransferEngine`, registered with vLLM's `WeightTransferEngineFactory`
as "lorarl" by `register` — a vLLM general plugin (entry point `vllm.general_plugins`), so every vLLM process knows it.
It applies a version only once the whole of it has arrived and checked out, so a failed transfer leaves the previous
version serving (see that module). `VllmWeightTransfer` is the trainer's side: it sends with lorarl's bucketed,
versioned, checksummed `BucketSender` while vLLM's `update_weights` receives, over

    gloo   CPU tensors, to an engine in another process (vLLM's CPU build);
    nccl   GPU tensors, to an engine on GPUs of its own;
    ipc    CUDA IPC handles of the trainer's buffers, to an engine's worker processes on the trainer's GPUs;
    local  the tensors themselves, to an engine whose worker shares the trainer's process (no wire, no copy).

`client` is anything with vLLM's four weight-sync calls taking plain dicts (vLLM's `VLLMWeightSyncClient` protocol):
vLLM's HTTP and Ray clients for a server or an actor, `OfflineClient` for an `LLM` object. Importing this module does
not import vLLM.
"""

import concurrent.futures
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from lorarl.weight_sync.group import create_sync_group, free_port
from lorarl.weight_sync.protocol import TensorSpec
from lorarl.weight_sync.sender import DEFAULT_BUCKET_BYTES, BucketSender, SyncStats, check_pair, pairs_of
from lorarl.weight_sync.shared import BucketMailbox, share_buckets

BACKEND = "lorarl"
CHANNELS = ("gloo", "nccl", "ipc", "local")
INCOMPLETE = "lorarl: the engine holds an incomplete version"  # in the error of an update that failed while applied


def adapter_path(directory: str | Path, version: int) -> Path:
    """Where the engine's first worker writes adapter version `version` (a peft directory) under `directory`."""
    return Path(directory) / f"v{version}"


def register() -> None:
    """Make the "lorarl" weight-transfer backend known to vLLM (run by vLLM in each of its processes, as a plugin)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # already registered
        WeightTransferEngineFactory.register_engine(
            BACKEND, "lorarl.weight_sync.vllm_engine", "LorarlWeightTransferEngine"
        )


class OfflineClient:
    """vLLM's weight-sync calls of an offline `vllm.LLM`, as vLLM's HTTP and Ray clients offer them for a server or
    an actor."""

    def __init__(self, llm: object):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


# --- the "local" channel: tensors handed to a worker of the same process -----------------------------------------

_handoffs: dict[int, tuple[int, object, object]] = {}
_handoff_ids = itertools.count(1)
_handoff_lock = threading.Lock()


def hand_off(version: int, payload: object, config: object = None) -> int:
    """Leave `payload` (named tensors) for the worker of this process; returns the id its update names."""
    with _handoff_lock:
        token = next(_handoff_ids)
        _handoffs[token] = (version, payload, config)
    return token


def take_handoff(token: int | None, version: int) -> tuple[object, object]:
    """The worker's side: the payload and config left under `token`, which must be of `version`."""
    with _handoff_lock:
        entry = _handoffs.pop(token, None) if token is not None else None
    if entry is None:
        raise ValueError(f"no tensors were handed over as {token!r}: the 'local' channel needs the trainer's process")
    if entry[0] != version:
        raise ValueError(f"the tensors handed over are version {entry[0]}, the update announced {version}")
    return entry[1], entry[2]


class VllmWeightTransfer:
    """The trainer's side of lorarl's transfer into the `workers` workers of a vLLM engine (every tensor-parallel
    rank), driven through `client`. `staging`: where each worker keeps a version until it is complete ("cpu", or
    "device" to spare host memory); `verify`: buckets carry checksums, which the workers check before applying."""

    def __init__(
        self,
        client: object,
        *,
        channel: str = "gloo",
        workers: int = 1,
        host: str = "127.0.0.1",
        port: int | None = None,
        timeout: float = 300.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str | None = None,
        staging: str = "cpu",
        verify: bool = True,
    ):
        if channel not in CHANNELS:
            raise ValueError(f"channel must be one of {CHANNELS}, got {channel!r}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if channel == "local" and workers != 1:
            raise ValueError(f"the 'local' channel reaches one worker (this process's), not {workers}")
        self.client, self.channel, self.timeout, self.bucket_bytes = client, channel, timeout, bucket_bytes
        self.sender: BucketSender | None = None
        self.mailbox: BucketMailbox | None = None
        self.device = torch.device(device) if device is not None else _default_device(channel)
        self._rpc = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorarl-vllm-rpc")
        port = port or (free_port(host) if channel != "local" else 0)
        info = {"channel": channel, "host": host, "port": port, "world_size": workers + 1, "rank_offset": 1,
                "timeout": timeout, "staging": staging}  # fmt: skip
        if channel == "ipc":  # the producer hosts the mailbox's store before the workers connect to it
            self.mailbox = BucketMailbox(host, port, rank=0, consumers=workers, timeout=timeout)
            client.init_weight_transfer_engine(info)
        elif channel == "local":
            client.init_weight_transfer_engine(info)
        else:  # the workers join the group while this side does
            joining = self._rpc.submit(client.init_weight_transfer_engine, info)
            group = create_sync_group(host, port, workers + 1, 0, backend=channel, timeout=timeout)
            joining.result(timeout=timeout)
            self.sender = BucketSender(group, bucket_bytes=bucket_bytes, device=self.device, timeout=timeout,
                                       verify=verify)  # fmt: skip

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        version: int,
        manifest: Sequence[TensorSpec | tuple] | None = None,
    ) -> SyncStats:
        """Send a version of the full weights; returns once every worker applied it. Raises if any did not — then
        the previous version keeps serving, unless the error says `INCOMPLETE` (it failed while being applied)."""
        return self._send(named_tensors, version, manifest, "weights")

    def send_factors(self, tensors: Mapping[str, torch.Tensor], *, version: int) -> SyncStats:
        """Send a factor set (`weight_sync.factors.factor_set`), over any channel as full weights go: the workers
        merge it into their weights from the base weights they keep (the first set carries them). Applied whole or
        not at all, as `send`."""
        return self._send(tensors, version, None, "factors")

    def _send(self, named_tensors, version: int, manifest: Sequence[TensorSpec | tuple] | None, kind: str) -> SyncStats:
        started = time.perf_counter()
        update = {"version": version, "kind": kind}
        if self.channel == "local":
            counted = _Checked(pairs_of(named_tensors), manifest)
            update["handoff"] = hand_off(version, counted)
            self._update(update, version, None)
            return SyncStats(version, counted.tensors, counted.nbytes, 0, time.perf_counter() - started)
        if self.channel == "ipc":

            def post() -> SyncStats:
                buckets = share_buckets(named_tensors, version=version, device=self.device,
                                        bucket_bytes=self.bucket_bytes, manifest=manifest)  # fmt: skip
                tensors, nbytes, count = self.mailbox.post(buckets)
                return SyncStats(version, tensors, nbytes, count, time.perf_counter() - started)

            return self._update(update, version, post)
        return self._update(update, version, lambda: self.sender.send(named_tensors, version=version,
                                                                       manifest=manifest))  # fmt: skip

    def send_adapter(
        self, tensors: Mapping[str, torch.Tensor], config: dict, *, version: int, directory: str
    ) -> tuple[SyncStats, str]:
        """Send a LoRA adapter; the engine's first worker writes it under `directory`. Returns the stats and the
        adapter's directory, for a `vllm.lora.request.LoRARequest` (give each version a request id of its own)."""
        started = time.perf_counter()
        update = {"version": version, "kind": "adapter", "adapter_dir": str(directory)}
        if self.channel == "local":
            update["handoff"] = hand_off(version, dict(tensors), config)
            self._update(update, version, None)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            stats = SyncStats(version, len(tensors), nbytes, 0, time.perf_counter() - started)
        elif self.channel == "ipc":
            raise ValueError("adapters go over a wire or the 'local' channel, not 'ipc'")
        else:
            stats = self._update(update, version, lambda: self.sender.send_adapter(tensors, config, version=version))
        return stats, str(adapter_path(directory, version))

    def _update(self, update: dict, version: int, send) -> SyncStats | None:
        return update_round(self.client, update, version, send, pool=self._rpc, timeout=self.timeout)

    def close(self) -> None:
        self._rpc.shutdown(wait=False)


def update_round(
    client: object,
    update: dict,
    version: int,
    send: Callable[[], SyncStats] | None = None,
    *,
    pool: concurrent.futures.Executor | None = None,
    timeout: float = 300.0,
) -> SyncStats | None:
    """One round of vLLM's weight-update API: `start_weight_update`, `update_weights(update)` — in a thread of `pool`
    while this thread runs `send` (the trainer's side of the transfer), if given —, then `finish_weight_update`,
    which makes `version` the engine's weight version. Returns what `send` returned. A failure of either side raises
    (the workers' own error first): the round is not finished, and the engine's version stays what it was."""
    client.start_weight_update()
    if send is None:  # the sender is elsewhere, or the "local" worker takes the tensors in this very call
        client.update_weights(update)
        stats = None
    else:
        receiving = pool.submit(client.update_weights, update)
        if receiving.done():  # refused at once (a bad update): no one would receive what is sent
            receiving.result()
        try:
            stats = send()
        except BaseException as error:
            failure = receiving.exception(timeout=timeout)  # the workers stop too (the transfer failed)
            if failure is not None:
                raise failure from error
            raise
        receiving.result(timeout=timeout)
    client.finish_weight_update(str(version))
    return stats


class _Checked:
    """Named tensors handed over in-process: checked against the manifest (when given), as `BucketSender.send`
    checks them, and counted as they are taken."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]], manifest: Sequence[TensorSpec | tuple] | None):
        self.pairs, self.tensors, self.nbytes = pairs, 0, 0
        self.specs = [TensorSpec.coerce(spec) for spec in manifest] if manifest is not None else None

    def __iter__(self):
        for name, tensor in self.pairs:
            check_pair(self.specs, self.tensors, name, tensor)
            self.tensors += 1
            self.nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor
        if self.specs is not None and self.tensors != len(self.specs):
            raise ValueError(f"the input yielded {self.tensors} tensors but the manifest lists {len(self.specs)}")


def _default_device(channel: str) -> torch.device:
    if channel in ("nccl", "ipc"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

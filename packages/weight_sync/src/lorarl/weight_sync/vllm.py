"""lorarl's weight transfer into vLLM, through vLLM's own weight-update API (its RL API).

    llm = LLM(model=path, weight_transfer_config={"backend": "lorarl"}, ...)
    transfer = VllmWeightTransfer(OfflineClient(llm), channel="gloo", workers=1)   # every worker joins
    transfer.send(Update("weights", step, iter_merged_weights(model), merged_weight_specs(model)))
    transfer.send(Update("adapter", step, tensors, config=peft_config), adapter_dir=d)   # for a LoRARequest
    transfer.send(Update("factors", step, factor_set(lora_factors(model), base)))        # the engine merges them

The receiving side is `vllm_engine.LorarlWeightTransferEngine`, registered with vLLM's `WeightTransferEngineFactory`
as "lorarl" by `register` — a vLLM general plugin (entry point `vllm.general_plugins`), so every vLLM process knows it.
It applies a version only once the whole of it has arrived and checked out, so a failed transfer leaves the previous
version serving (see that module). `VllmWeightTransfer` is the trainer's side: it sends over any registered channel
(`weight_sync.channels`: gloo, nccl, ipc, local) while vLLM's `update_weights` receives.

`client` is anything with vLLM's four weight-sync calls taking plain dicts (vLLM's `VLLMWeightSyncClient` protocol):
vLLM's HTTP and Ray clients for a server or an actor, `OfflineClient` for an `LLM` object. Importing this module does
not import vLLM.
"""

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lorarl.weight_sync.channels import channel_class
from lorarl.weight_sync.sender import DEFAULT_BUCKET_BYTES, SyncStats
from lorarl.weight_sync.update import Update

BACKEND = "lorarl"
INCOMPLETE = "lorarl: the engine holds an incomplete version"  # in the error of an update that failed while applied


def adapter_path(directory: str | Path, version: int) -> Path:
    """Where the engine's first worker writes adapter version `version` (a peft directory) under `directory`."""
    return Path(directory) / f"v{version}"


class HarmlessLoadWarnings(logging.Filter):
    """Drops vLLM's warnings that every lorarl engine would print and that say nothing wrong: a layer that holds no
    checkpoint weights (a rotary embedding's computed cache) "failed to load" at every reload of full weights, and a
    float32 checkpoint loaded into the lower-precision engine `rollout.dtype` chose warns once per tensor. Others
    pass."""

    NARROWED = ("torch.bfloat16", "torch.float16")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights":
            return not str(record.args[0]).endswith("RotaryEmbedding")
        if str(record.msg).startswith("Attempted to load weight %s with dtype %s into parameter with dtype"):
            return not (str(record.args[1]) == "torch.float32" and str(record.args[2]) in self.NARROWED)
        return True


QUIETED = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.models.utils")


def register() -> None:
    """Make the "lorarl" weight-transfer backend known to vLLM (run by vLLM in each of its processes, as a plugin),
    and quiet the warnings of its loaders that lorarl knows to be harmless there."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name in QUIETED:
        log = logging.getLogger(name)
        if not any(isinstance(f, HarmlessLoadWarnings) for f in log.filters):
            log.addFilter(HarmlessLoadWarnings())

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


class VllmWeightTransfer:
    """The trainer's side of lorarl's transfer into the `workers` workers of a vLLM engine (every tensor-parallel
    rank), driven through `client`, over `channel` (a name from `weight_sync.channels`). `staging`: where each worker
    keeps a version until it is complete ("cpu", or "device" to spare host memory); `verify`: buckets carry
    checksums, which the workers check before applying."""

    def __init__(
        self,
        client: object,
        *,
        channel: str = "gloo",
        workers: int = 1,
        host: str = "127.0.0.1",
        timeout: float = 300.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str | None = None,
        staging: str = "cpu",
        verify: bool = True,
    ):
        mechanism = channel_class(channel)
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.client, self.timeout = client, timeout
        self._rpc = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorarl-vllm-rpc")
        link = mechanism.new_link(workers, host=host, timeout=timeout)
        info = {"channel": channel, "host": link.host, "port": link.port, "world_size": link.world_size,
                "rank_offset": 1, "timeout": timeout, "staging": staging}  # fmt: skip
        options = {"device": device, "bucket_bytes": bucket_bytes, "verify": verify}
        if mechanism.opens_together:  # the workers join while this side does
            joining = self._rpc.submit(client.init_weight_transfer_engine, info)
            self.channel = mechanism(link, 0, **options)
            joining.result(timeout=timeout)
        else:  # this side opens first (it hosts what the workers connect to)
            self.channel = mechanism(link, 0, **options)
            client.init_weight_transfer_engine(info)

    def send(self, update: Update, *, adapter_dir: str | Path | None = None) -> SyncStats:
        """Send one version; returns once every worker applied it. Raises if any did not — then the previous version
        keeps serving, unless the error says `INCOMPLETE` (it failed while being applied). An adapter is written by
        the engine's first worker under `adapter_dir`, at `adapter_path(adapter_dir, version)`, for a
        `vllm.lora.request.LoRARequest` (give each version a request id of its own)."""
        started = time.perf_counter()
        info = {"version": update.version, "form": update.form}
        if update.form == "adapter":
            if adapter_dir is None:
                raise ValueError("an adapter update needs adapter_dir (where the engine's first worker writes it)")
            info["adapter_dir"] = str(adapter_dir)
        stats = update_round(self.client, info, update.version, lambda: self.channel.send(update), pool=self._rpc,
                             timeout=self.timeout, hands_over=self.channel.hands_over)  # fmt: skip
        return dataclasses.replace(stats, seconds=time.perf_counter() - started)

    def close(self) -> None:
        self._rpc.shutdown(wait=False)
        self.channel.close()


def update_round(
    client: object,
    update: dict,
    version: int,
    send: Callable[[], SyncStats] | None = None,
    *,
    pool: concurrent.futures.Executor | None = None,
    timeout: float = 300.0,
    hands_over: bool = False,
) -> SyncStats | None:
    """One round of vLLM's weight-update API: `start_weight_update`, `update_weights(update)` — in a thread of `pool`
    while this thread runs `send` (the trainer's side of the transfer), if given; after it, with `hands_over` (the
    workers take what `send` left, in this process) —, then `finish_weight_update`, which makes `version` the
    engine's weight version. Returns what `send` returned. A failure of either side raises (the workers' own error
    first): the round is not finished, and the engine's version stays what it was."""
    client.start_weight_update()
    if send is None or hands_over:  # the sender is elsewhere, or left the update for the workers
        stats = send() if send is not None else None
        client.update_weights(update)
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

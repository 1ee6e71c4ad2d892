"""`rollout.engine=vllm` inline: vLLM on the trainer's GPUs, fed without a wire and asleep while the trainer trains."""

import concurrent.futures
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from lorarl.trainer.engines.base import Capabilities, Completion, EngineError, GeneratesWhenAsked
from lorarl.trainer.engines.vllm_worker import VllmSettings, engine_args, generate_with_vllm
from lorarl.weight_sync import DEFAULT_BUCKET_BYTES, SyncStats, TensorSpec, free_port, save_adapter
from lorarl.weight_sync.shared import BucketMailbox, share_buckets


class ColocatedVllmEngine(GeneratesWhenAsked):
    """vLLM on the trainer's GPUs (`rollout.devices` unset), started by the trainer's process (rank 0).

    Tensor-parallel size 1: the engine's worker runs in the trainer's process, and the weights go from
    `iter_merged_weights` to `load_weights` on the same device, one layer at a time, with no copy in between. Larger:
    its workers are processes of their own on GPUs 0..TP-1 (those of the trainer's ranks), and the weights go as shared
    buckets — CUDA IPC handles of packed buffers and of the merged tensors themselves on the trainer's GPU, which every
    worker reads in place and shards (`lorarl.weight_sync.shared`). With `rollout.sync=adapter` the adapter is written
    where the engine loads it from. The engine sleeps while the trainer trains (`sleep()`, called by the trainer after
    the rollouts): level 2 — weights and KV cache freed — with merged sync, since the next sync replaces every weight;
    level 1 — weights to CPU — with adapter sync, whose base must survive. `sync_weights` wakes it. A sync that fails
    part-way leaves the engine refusing to generate: its weights are neither the old version nor the new.
    """

    @classmethod
    def start(cls, settings: VllmSettings, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> "ColocatedVllmEngine":
        """Start vLLM for these settings (sleep mode on) on the trainer's GPUs."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        from vllm import LLM

        workers = settings.tensor_parallel_size
        return cls(LLM(**engine_args(settings), enable_sleep_mode=True), workers=workers, in_process=workers == 1,
                   adapter_mode=settings.adapter_rank is not None, bucket_bytes=bucket_bytes,
                   timeout=settings.timeout)  # fmt: skip

    capabilities = Capabilities(sleep=True)

    def __init__(self, llm, *, workers: int, in_process: bool, adapter_mode: bool, bucket_bytes: int, timeout: float,
                 device: torch.device | str | None = None):  # fmt: skip
        """Around a running `llm` with lorarl's worker extension and `workers` workers; `in_process`: its one worker
        shares this process, else the weights go as shared buckets on `device` (default: the current CUDA one)."""
        self.llm, self.bucket_bytes, self.mailbox, self.rpc = llm, bucket_bytes, None, None
        if not in_process:
            self.device = (
                torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
            )
            self.rpc = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorarl-vllm-rpc")
            port = free_port()
            self.mailbox = BucketMailbox("127.0.0.1", port, rank=0, consumers=workers, timeout=timeout)
            self.llm.collective_rpc("lorarl_join_mailbox", args=("127.0.0.1", port, workers, timeout))
        self.adapter_mode = adapter_mode
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="lorarl-adapter-"))
        self.version, self.asleep, self.lora_request, self.broken = 0, False, None, None

    def generate(self, prompts, *, n, temperature, top_p, max_tokens, seed) -> list[Completion]:
        if self.broken:
            raise EngineError(f"the colocated engine holds half-loaded weights ({self.broken}): it cannot generate")
        if self.asleep:
            if not self.adapter_mode:
                raise EngineError("the colocated engine freed its weights to sleep: sync weights before generating")
            self.llm.wake_up()
            self.asleep = False
        return generate_with_vllm(
            self.llm, self.lora_request, self.version, prompts, n, temperature, top_p, max_tokens, seed
        )

    def sleep(self) -> None:
        """Free the GPU for training (see the class docstring for what each mode keeps)."""
        if not self.asleep:
            self.llm.sleep(level=1 if self.adapter_mode else 2)
            self.asleep = True

    def sync_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, manifest: Sequence[TensorSpec | tuple]
    ) -> SyncStats:
        started = time.perf_counter()
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        try:
            tensors, nbytes, buckets = self._load(named_tensors, version, manifest)
        except BaseException as error:
            self.broken = f"the sync of version {version} failed: {type(error).__name__}: {error}"
            raise
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])  # a fresh cache
            self.asleep = False
        else:
            self.llm.reset_prefix_cache()  # cached KV of the old weights must not be reused
        self.version, self.broken = version, None
        return SyncStats(version, tensors, nbytes, buckets, time.perf_counter() - started)

    def _load(self, named_tensors, version: int, manifest) -> tuple[int, int, int]:
        """Into every worker: handed over in this process, or as shared buckets through the mailbox (the workers
        take them in a `collective_rpc` that runs while this thread posts them)."""
        if self.mailbox is None:
            (tensors, nbytes), *_ = self.llm.collective_rpc("lorarl_load_weights", args=(named_tensors,))
            return tensors, nbytes, 0
        loading = self.rpc.submit(self.llm.collective_rpc, "lorarl_load_from_mailbox")
        try:
            posted = self.mailbox.post(share_buckets(named_tensors, version=version, device=self.device,
                                                     bucket_bytes=self.bucket_bytes, manifest=manifest))  # fmt: skip
        except BaseException:
            loading.exception(timeout=self.mailbox.timeout)  # the workers stop too (told by the mailbox)
            raise
        results = loading.result(timeout=self.mailbox.timeout)
        if any(tuple(loaded) != (version, *posted[:2]) for loaded in results):
            raise EngineError(f"vLLM workers report {results} (version, tensors, bytes) after version {version}")
        return posted

    def sync_adapter(self, tensors: dict[str, torch.Tensor], config: dict, *, version: int) -> SyncStats:
        from vllm.lora.request import LoRARequest

        started = time.perf_counter()
        directory = self.adapter_dir / f"v{version}"
        save_adapter(tensors, config, directory)
        self.lora_request = LoRARequest(f"v{version}", version + 1, str(directory))
        self.version = version
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return SyncStats(version, len(tensors), nbytes, 0, time.perf_counter() - started)

    def checksum(self) -> str:
        raise EngineError("vLLM holds its weights fused: no checksum comparable to the trainer's")

    def close(self) -> None:
        if self.rpc is not None:
            self.rpc.shutdown(wait=False)
        del self.llm

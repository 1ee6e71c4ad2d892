"""`trainer serve --sampler vllm`: every run's sampler weights served by one vLLM engine (GPUs, or its CPU build) —
vLLM's multi-LoRA decodes requests for different runs' snapshots in one batch, each a `LoRARequest` of its own. A
snapshot gets a fresh request id (vLLM serves a reused id's old weights, and keys its prefix cache by the id), and
reaches the engine through a directory in shared memory (/dev/shm where there is one): vLLM's LoRA loader reads
paths only, and nothing goes to a disk. The engine holds its own copy of the base weights, loaded from the same
files as the trainer's; training never changes them (runs are adapters), so they never need a sync."""

import itertools
import os
import shutil
import tempfile
from pathlib import Path

from lorarl.trainer.engines.base import SamplingParams as EngineSampling
from lorarl.trainer.engines.vllm_worker import VllmSettings, sampling_args, start_llm
from lorarl.trainer.serve.sampling import SampleRequest, Sequence, Snapshot, check_request
from lorarl.trainer.serve.tenancy import RequestError, SharedBase, write_adapter

SHARED_MEMORY = Path("/dev/shm")


class VllmSampler:
    """Samples with vLLM for every run on one base: the most recently used snapshots stay loaded in the engine
    (`max_loras` of them in one batch; vLLM loads others again from their directory)."""

    def __init__(self, base: SharedBase, *, max_lora_rank: int = 64, max_loras: int = 8, kv_cache_gb: float = 1.0,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.3, seed: int = 0):  # fmt: skip
        self.base, self.max_lora_rank = base, max_lora_rank
        settings = VllmSettings(str(base.path), base.dtype, 1, gpu_memory_utilization, max_model_len, seed,
                                max_lora_rank, None, device=base.device.type, kv_cache_gb=kv_cache_gb,
                                max_loras=max_loras)  # fmt: skip
        self.llm = start_llm(settings)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.requests: dict[str, object] = {}  # snapshot path -> its LoRARequest
        self._ids = itertools.count(1)
        where = SHARED_MEMORY if SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK) else None
        self.directory = Path(tempfile.mkdtemp(prefix="lorarl-serve-", dir=where))

    def activate(self, path: str, snapshot: Snapshot):
        """The `LoRARequest` of `snapshot`, its adapter written for the engine the first time."""
        from vllm.lora.request import LoRARequest

        if path in self.requests:
            return self.requests[path]
        if snapshot.shape.rank > self.max_lora_rank:
            raise RequestError(f"{path}: LoRA rank {snapshot.shape.rank} is above the vLLM sampler's "
                               f"--max-lora-rank {self.max_lora_rank}")  # fmt: skip
        lora_id = next(self._ids)
        directory = self.directory / str(lora_id)
        write_adapter(directory, self.base.lora_config(snapshot.shape), snapshot.tensors)
        request = LoRARequest(f"snapshot-{lora_id}", lora_id, str(directory))
        try:  # loaded now, so that one that vLLM cannot serve fails its own request, not a batch of others
            self.llm.llm_engine.add_lora(request)
        except Exception as error:
            shutil.rmtree(directory, ignore_errors=True)
            raise RequestError(f"{path}: vLLM cannot serve these sampler weights ({error}); --sampler hf can, or a "
                               "run without the layers it names (e.g. train_unembed=False)") from None  # fmt: skip
        self.requests[path] = request
        return request

    def forget(self, path: str) -> None:
        request = self.requests.pop(path, None)
        if request is not None:
            self.llm.llm_engine.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)

    def check(self, request: SampleRequest) -> None:
        check_request(self.base, request)
        if len(request.prompt) + request.max_tokens > self.max_model_len:
            raise RequestError(f"prompt ({len(request.prompt)} tokens) and max_tokens ({request.max_tokens}) exceed "
                               f"the vLLM sampler's context of {self.max_model_len} tokens")  # fmt: skip
        self.params(request)

    @staticmethod
    def params(request: SampleRequest):
        """vLLM's sampling parameters of `request`: the sampled tokens' log-probs, stops kept in the tokens."""
        import vllm

        try:
            engine = EngineSampling(n=request.num_samples, temperature=request.temperature, top_p=request.top_p,
                                    max_tokens=request.max_tokens, stop=request.stop_strings)  # fmt: skip
        except ValueError as error:
            raise RequestError(f"sampling_params: {error}") from None
        args = {**sampling_args(engine), "seed": request.seed}
        if request.stop_tokens:
            args["stop_token_ids"] = list(request.stop_tokens)
        return vllm.SamplingParams(**args)

    def sample_many(self, requests: list[tuple[object | None, SampleRequest]]) -> list[list[Sequence]]:
        """The responses to each request, all in one `generate`: vLLM batches them whichever snapshot each asks for."""
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(request.prompt)) for _, request in requests]
        outputs = self._generate(prompts, [self.params(request) for _, request in requests],
                                 [adapter for adapter, _ in requests])  # fmt: skip
        answers = []
        for output in outputs:
            sequences = []
            for sample in output.outputs:
                tokens = list(sample.token_ids)
                logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs, tokens, strict=True)]
                sequences.append(Sequence(tokens, logprobs, "stop" if sample.finish_reason == "stop" else "length"))
            answers.append(sequences)
        return answers

    def prompt_logprobs(self, adapter: object | None, prompt: list[int]) -> list[float | None]:
        """Each prompt token's log-prob given those before it (None for the first), as vLLM scores the prompt."""
        import vllm
        from vllm.inputs import TokensPrompt

        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        (output,) = self._generate([TokensPrompt(prompt_token_ids=list(prompt))], params, adapter)
        scored = output.prompt_logprobs
        return [None, *(float(step[token].logprob) for step, token in zip(scored[1:], prompt[1:], strict=True))]

    def _generate(self, prompts: list, params, adapters) -> list:
        """`LLM.generate`; after a failure its requests are aborted — left in the engine, they would fail every later
        round too."""
        try:
            return self.llm.generate(prompts, params, lora_request=adapters, use_tqdm=False)
        except Exception:
            engine = self.llm.llm_engine
            engine.abort_request(list(engine.output_processor.request_states))
            raise

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.directory, ignore_errors=True)

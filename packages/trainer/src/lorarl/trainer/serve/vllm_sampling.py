"""`trainer serve --sampler vllm`: every run's sampler weights served by one vLLM engine (GPUs, or its CPU build).

Two ways to serve a snapshot, `adapters=`:
- "batched" (GPUs): vLLM's multi-LoRA decodes requests for different runs' snapshots in one batch, each a
  `LoRARequest` of its own — a fresh request id per snapshot (vLLM serves a reused id's old weights, and keys its
  prefix cache by the id), the adapter handed over through a directory in shared memory (/dev/shm where there is one:
  vLLM's LoRA loader reads paths only, and nothing goes to a disk);
- "merged" (the CPU): a round's requests decode snapshot by snapshot, each with that snapshot's factors merged into
  the engine's weights by lorarl's factor sync (from the pristine base the transfer engine keeps, which in this
  process is the trainer's own frozen base: no copy), the base's requests with the pristine weights. vLLM's CPU LoRA
  kernels gather a copy of the factors for every token, which makes a LoRA decode several times slower than the base
  model's; a merged one costs what the base does. A snapshot whose unembedding is tied to the embeddings (vLLM loads
  no separate head to merge into) is served as a LoRA request with the pristine weights.
The engine holds its own copy of the base weights, loaded from the same files as the trainer's."""

import itertools
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from lorarl.trainer.engines.base import SamplingParams as EngineSampling
from lorarl.trainer.engines.vllm_worker import VllmSettings, sampling_args, start_llm, to_completions
from lorarl.trainer.serve.sampling import SampleRequest, Sequence, Snapshot, check_request
from lorarl.trainer.serve.tenancy import ALPHA, ATTENTION, MLP, RequestError, SharedBase, write_adapter
from lorarl.trainer.weights import base_weights
from lorarl.weight_sync import Update
from lorarl.weight_sync.factors import factor_set

SHARED_MEMORY = Path("/dev/shm")
PEFT_PREFIX = "base_model.model."
UNKNOWN = object()  # the engine's weights after a factor sync that failed: synced again before the next decode


@dataclass(frozen=True)
class Served:
    """A snapshot as the engine serves it: `factors` merged into its weights, or `lora`, a `LoRARequest`."""

    path: str
    factors: dict | None = None  # base-weight name -> (lora_A, lora_B, scale, fan_in_fan_out)
    lora: object | None = None


def snapshot_factors(snapshot: Snapshot) -> dict:
    """A snapshot's factors keyed by the base weights they add to (`lora_merge.lora_factors`' form)."""
    scale = ALPHA / snapshot.shape.rank
    return {key.removeprefix(PEFT_PREFIX).replace(".lora_A.weight", ".weight"):
            (a, snapshot.tensors[key.replace(".lora_A.", ".lora_B.")], scale, False)
            for key, a in snapshot.tensors.items() if ".lora_A." in key}  # fmt: skip


class VllmSampler:
    """Samples with vLLM for every run on one base (`adapters`: "merged", "batched", or None — merged on the CPU,
    batched on GPUs; see the module's docstring)."""

    def __init__(self, base: SharedBase, *, adapters: str | None = None, max_lora_rank: int = 64, max_loras: int = 8,
                 kv_cache_gb: float = 1.0, max_model_len: int | None = None, gpu_memory_utilization: float = 0.3,
                 seed: int = 0):  # fmt: skip
        self.base, self.max_lora_rank = base, max_lora_rank
        self.adapters = adapters or ("merged" if base.device.type == "cpu" else "batched")
        if self.adapters not in ("merged", "batched"):
            raise ValueError(f"adapters: expected 'merged' or 'batched', got {adapters!r}")
        settings = VllmSettings(str(base.path), base.dtype, 1, gpu_memory_utilization, max_model_len, seed,
                                max_lora_rank, None, device=base.device.type, kv_cache_gb=kv_cache_gb,
                                max_loras=max_loras)  # fmt: skip
        self.llm = start_llm(settings)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.served: dict[str, Served] = {}  # snapshot path -> how the engine serves it
        self.holding: object = None  # the path whose factors the engine's weights hold (None: the base's)
        self.transfer = None  # the factor sync into the engine, opened with the first merge
        self.base_sent = False  # the transfer engine keeps the pristine base (sent with the first factor set)
        self._ids = itertools.count(1)  # LoRA request ids, and factor sync versions
        where = SHARED_MEMORY if SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK) else None
        self.directory = Path(tempfile.mkdtemp(prefix="lorarl-serve-", dir=where))

    def mergeable(self, snapshot: Snapshot) -> bool:
        tied = bool(getattr(self.base.base.config, "tie_word_embeddings", False))
        return self.adapters == "merged" and not (snapshot.shape.train_unembed and tied)

    def activate(self, path: str, snapshot: Snapshot) -> Served:
        """How the engine serves `snapshot`: its factors (merged when its requests decode), or a `LoRARequest`, its
        adapter written for the engine and loaded now (one it cannot serve fails this request alone)."""
        from vllm.lora.request import LoRARequest

        if path in self.served:
            return self.served[path]
        if self.mergeable(snapshot):
            self.served[path] = Served(path, factors=snapshot_factors(snapshot))
            return self.served[path]
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
        self.served[path] = Served(path, lora=request)
        return self.served[path]

    def forget(self, path: str) -> None:
        served = self.served.pop(path, None)
        if self.holding == path:  # a snapshot saved again under this path must be merged afresh
            self.holding = UNKNOWN
        if served is not None and served.lora is not None:
            self.llm.llm_engine.remove_lora(served.lora.lora_int_id)
            shutil.rmtree(served.lora.lora_path, ignore_errors=True)

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

    def sample_many(self, requests: list[tuple[Served | None, SampleRequest]]) -> list[list[Sequence]]:
        """The responses to each request: those that the same engine weights serve in one `generate` — every request
        when batched (vLLM's multi-LoRA), one merged snapshot's when merged — the weights the engine holds first."""
        groups: dict[object, list[int]] = {}
        for i, (served, _) in enumerate(requests):
            groups.setdefault(self._weights(served), []).append(i)
        answers: list[list[Sequence]] = [[] for _ in requests]
        for key in sorted(groups, key=lambda k: k != self.holding):
            members = groups[key]
            self._hold(requests[members[0]][0])
            outputs = self._generate([self._prompt(requests[i][1]) for i in members],
                                     [self.params(requests[i][1]) for i in members],
                                     [self._lora(requests[i][0]) for i in members])  # fmt: skip
            for completion in to_completions(outputs, version=0):
                answers[members[completion.prompt_index]].append(
                    Sequence(list(completion.token_ids), list(completion.logprobs),
                             "stop" if completion.finished else "length"))  # fmt: skip
        return answers

    @staticmethod
    def _weights(served: Served | None) -> str | None:
        """The engine weights that serve `served`: its path where merged, None (the base's) for the base or a LoRA."""
        return served.path if served is not None and served.factors is not None else None

    def _hold(self, served: Served | None) -> None:
        """Make the engine's weights those that serve `served` (`_weights`): the base's merged with its factors, or
        the base's alone — by a factor sync, only where they are not that already."""
        key = self._weights(served)
        if key == self.holding:
            return
        from lorarl.weight_sync.vllm import OfflineClient, VllmWeightTransfer

        if self.transfer is None:  # in this process: the workers take the trainer's tensors as they are
            self.transfer = VllmWeightTransfer(OfflineClient(self.llm), channel="local", workers=1)
        factors = served.factors if key is not None else {}
        self.holding = UNKNOWN
        base = None if self.base_sent else self._base()
        self.transfer.send(Update("factors", next(self._ids), factor_set(factors, base)))
        self.base_sent = True
        self.llm.reset_prefix_cache()  # its blocks were computed with other weights
        self.holding = key

    def _base(self) -> dict:
        """The base weights of every layer a snapshot may adapt (the pristine weights each merge starts from)."""
        names = set()
        for name, module in self.base.base.named_modules():  # (peft's layers wrap the linears as `.base_layer`)
            name = name.removesuffix(".base_layer")
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in ATTENTION + MLP:
                names.add(name + ".weight")
        return base_weights(self.base.model or self.base.base, dict.fromkeys(names))

    @staticmethod
    def _lora(served: Served | None):
        return served.lora if served is not None else None

    @staticmethod
    def _prompt(request: SampleRequest):
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=list(request.prompt))

    def prompt_logprobs(self, served: Served | None, prompt: list[int]) -> list[float | None]:
        """Each prompt token's log-prob given those before it (None for the first), as vLLM scores the prompt."""
        import vllm

        self._hold(served)
        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        (output,) = self._generate([self._prompt(SampleRequest(prompt, 1, 1))], params, self._lora(served))
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
        if self.transfer is not None:
            self.transfer.close()
        self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.directory, ignore_errors=True)

"""`rollout.engine=hf`: a Hugging Face causal LM generating with lorarl's decode loop (`decode.py`), on CPU or GPU.

Updates arrive as they are (inline) or over a gloo channel (a process or Ray actor of its own); the worker reads their
form: full weights are copied into the model (over a channel, landing straight in its parameters); an adapter is
served unmerged by peft on the weights the worker holds; a factor set is merged straight into the model's weights from
the pristine base the worker keeps.
"""

import contextlib
import functools
import hashlib
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lorarl.trainer import cpu_attention, threads
from lorarl.trainer.decode import StopStrings, decode, left_padded, response_end
from lorarl.trainer.engines import HFEngineSettings
from lorarl.trainer.engines.base import (
    Capabilities,
    Completion,
    EngineContext,
    Sampling,
    SamplingParams,
    Worker,
    stop_strings,
)
from lorarl.trainer.routing import Recorder, Routers
from lorarl.weight_sync import Channel, Link, SyncStats, Update, copy_into, open_channel, save_adapter
from lorarl.weight_sync.factors import FactorMerger, read_factor_set


@dataclass(frozen=True)
class HFSettings:
    model_path: str
    dtype: torch.dtype
    device: str
    eos: int
    pad: int
    batch_size: int  # sequences generated at once
    threads: int | None = None  # torch's CPU threads in a process of its own (None: adapted to the load)
    inline: bool = False  # in the trainer's process, whose threads are the trainer's
    timeout: float = 600.0
    sync_backend: str = "gloo"
    sync_ranks: int = 1
    record_routes: bool = False  # completions carry their routes (a mixture of experts)


class HFWorker(Worker):
    """A Hugging Face model with lorarl's decode loop (CPU or GPU), and in a process or actor of its own its end of
    the weight-sync group."""

    capabilities = Capabilities(checksum=True)

    @classmethod
    def settings(cls, own: HFEngineSettings, context: EngineContext) -> HFSettings:
        # generating on the CPU beside the training (rollout.overlap): one core, and the trainer takes the others
        threads = 1 if context.overlap and context.device == "cpu" else context.threads or None
        return HFSettings(context.model_path, context.dtype, context.device, context.eos_token_id,
                          context.pad_token_id, own.batch_size, threads, context.inline,
                          record_routes=context.record_routes)  # fmt: skip

    def __init__(self, settings: HFSettings):
        from transformers import AutoModelForCausalLM

        self.settings = settings
        if not settings.inline:
            threads.configure(settings.threads)
        model = AutoModelForCausalLM.from_pretrained(settings.model_path, dtype=settings.dtype)
        self.model = model.to(settings.device).eval()
        cpu_attention.use_on_cpu(self.model, torch.device(settings.device))
        self.version = 0  # the weights from disk
        self.channel: Channel | None = None
        self.adapter = None  # a peft model around self.model while an adapter is served unmerged
        self.factors = FactorMerger(settings.dtype)  # the pristine base weights of the factor sync
        self.tokenizer = None  # loaded for stop strings

    @threads.busy()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        model = self.adapter if self.adapter is not None else self.model
        if stop_strings(sampling) and self.tokenizer is None:  # stop strings are text
            from lorarl.trainer.models import load_tokenizer

            self.tokenizer = load_tokenizer(self.settings.model_path)
        return generate_with_hf(model, self.settings, self.version, prompts, sampling, self.tokenizer)

    @threads.busy()
    def apply(self, update: Update, *, shared: bool = False) -> SyncStats:
        """Install `update`, by its form (`shared`: its tensors are the trainer's own)."""
        started = time.perf_counter()
        if update.form == "weights":
            self.drop_adapter()
            stats = copy_into(self.model, update.named(), version=update.version, manifest=update.specs,
                              strict=update.full)  # fmt: skip
        else:
            tensors = update.tensors
            if update.form == "adapter":
                owned = {n: t.detach().clone() for n, t in tensors.items()} if shared else tensors  # it trains on
                self.serve_adapter(owned, update.config)
            else:
                self.merge_factors(tensors, share=shared)
            stats = SyncStats(update.version, len(tensors), sum(t.nbytes for t in tensors.values()), 0, 0.0)
        self.version = update.version
        stats.seconds = time.perf_counter() - started
        return stats

    def serve_adapter(self, tensors: dict[str, torch.Tensor], config: dict) -> None:
        """A LoRA adapter, served unmerged by peft on the weights this worker holds."""
        from peft import PeftModel, set_peft_model_state_dict

        if self.adapter is None:
            with tempfile.TemporaryDirectory() as directory:
                save_adapter(tensors, config, Path(directory))
                self.adapter = PeftModel.from_pretrained(self.model, directory).eval()
        else:
            set_peft_model_state_dict(self.adapter, tensors)

    def merge_factors(self, tensors: dict[str, torch.Tensor], *, share: bool) -> None:
        """A factor set merged into the model's own weights from the pristine base weights (those the set adapts,
        kept from the first set; `share`: the trainer's own tensors, in its process). Checked whole first: a set
        that does not fit changes nothing."""
        factors, base = read_factor_set(tensors)
        params = {
            name.replace(".base_layer", ""): p for name, p in self.model.named_parameters() if "lora_" not in name
        }  # its own weights, also under an adapter served (which unload() keeps)
        unknown = [name for name in factors if name not in params]
        if unknown:
            raise ValueError(f"the factor set adapts weights the model lacks: {unknown[:5]}")
        kept = {name: t.to(params[name].device) for name, t in base.items() if name in factors}  # gloo: on the CPU
        self.factors.store(kept, share=share)
        merging = self.factors.merged(factors, outputs={name: params[name].data for name in factors})  # checked
        self.drop_adapter()  # the parameters stay the same objects
        with torch.no_grad():
            for _ in merging:
                pass

    def drop_adapter(self) -> None:
        if self.adapter is not None:
            self.model, self.adapter = self.adapter.unload(), None  # the LoRA layers out, the base as it was

    # --- over a channel (a process or actor of its own) -----------------------------------------------------------

    def join(self, host: str, port: int, world_size: int, rank: int) -> int:
        link = Link(host, port, world_size - 1, self.settings.timeout)
        self.channel = open_channel(self.settings.sync_backend, link, rank)
        return self.version

    @threads.busy()
    def receive(self, form: str, version: int) -> int:
        if form == "weights":  # landing straight in the model's parameters
            self.drop_adapter()
            self.version = self.channel.load_into(self.model, version)
        else:
            self.apply(self.channel.receive(form, version))
        return self.version

    def checksum(self) -> str:
        return checksum(self.model.state_dict().items())


def checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of names and bytes, in order: equal only for bit-identical weights (the trainer's merged weights,
    `iter_merged_weights`, against an engine's model)."""
    digest = hashlib.sha256()
    for name, tensor in named_tensors:
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def generate_with_hf(
    model,
    settings: HFSettings,
    version: int,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    tokenizer=None,
) -> list[Completion]:
    """`n` responses per prompt, batched, seeded; a response ends at `eos`, at one of its `stop` strings (read with
    `tokenizer`, which stop strings need) or at its `max_tokens`. One `SamplingParams` for all prompts draws from one
    generator seeded `sampling.seed`; one per prompt: each prompt from a stream of its own seed, in
    batches of the prompts that sample alike (temperature, top_p, stop strings, min_tokens)."""
    if isinstance(sampling, SamplingParams):
        return _generate(model, settings, version, [list(p) for p in prompts], range(len(prompts)), sampling,
                         tokenizer)  # fmt: skip
    groups: dict[tuple, list[int]] = {}
    for i, params in enumerate(sampling):
        groups.setdefault((params.n, params.temperature, params.top_p, params.stop, params.min_tokens), []).append(i)
    completions = []
    for members in groups.values():
        completions += _generate(model, settings, version, [list(prompts[i]) for i in members], members,
                                 [sampling[i] for i in members], tokenizer)  # fmt: skip
    return sorted(completions, key=lambda c: c.prompt_index)  # stable: a prompt's n responses stay in order


def _generate(model, settings: HFSettings, version: int, prompts: list[list[int]], indices: Sequence[int],
              sampling: Sampling, tokenizer) -> list[Completion]:  # fmt: skip
    """Prompts that sample alike (`sampling`: one for all, or one each differing in seed and max_tokens alone),
    decoded `settings.batch_size` sequences at a time; completion i answers prompt `indices[i]`."""
    each = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    first = each[0]
    if first.stop and tokenizer is None:
        raise ValueError(f"stop strings {first.stop} need the model's tokenizer")
    eos, pad, device, n = settings.eos, settings.pad, settings.device, first.n
    generator = torch.Generator(device=device).manual_seed(first.seed)
    own_streams = not isinstance(sampling, SamplingParams)
    completions = []
    per_batch = max(1, settings.batch_size // n)
    routers = Routers.of(model) if settings.record_routes else None
    for start in range(0, len(prompts), per_batch):
        chunk, params = prompts[start : start + per_batch], each[start : start + per_batch]
        ids, mask = left_padded(chunk, pad, device)
        stop = None
        if first.stop:
            candidates = stop_candidates(tokenizer, first.stop, model.get_output_embeddings().weight.shape[0])
            stop = StopStrings(tokenizer, first.stop, candidates)
        limits = [p.max_tokens for p in params for _ in range(n)]
        seeds = [p.seed + 7919 * k for p in params for k in range(n)] if own_streams else None
        recorder = Recorder(routers) if routers is not None else None
        with recorder.recording() if recorder is not None else contextlib.nullcontext():
            tokens, logp = decode(model, ids, mask, n=n, max_tokens=max(limits), temperature=first.temperature,
                                  top_p=first.top_p, eos=eos, pad=pad, generator=generator, stop=stop,
                                  min_tokens=first.min_tokens, seeds=seeds,
                                  limits=limits if own_streams else None)  # fmt: skip
        stopped = stop.ends if stop is not None else {}  # row -> its length with the stop string
        route = None if recorder is None else decoded_routes(recorder, mask, n)
        for row, (row_tokens, row_logp) in enumerate(zip(tokens.tolist(), logp.tolist(), strict=True)):
            row_tokens = row_tokens[: limits[row]]  # what follows a row's own limit is padding
            length, finished = response_end(row_tokens, eos, stopped.get(row))
            completions.append(Completion(indices[start + row // n], tuple(row_tokens[:length]),
                                          tuple(row_logp[:length]), finished, version,
                                          None if route is None else route(row, length)))  # fmt: skip
    return completions


def decoded_routes(recorder: Recorder, mask: torch.Tensor, n: int) -> Callable[[int, int], np.ndarray]:
    """What gives the route of a decoded row (of `n` per prompt) of a given length: its prompt's (the prefill, the
    first call, of the left-padded prompts under `mask`), then one row per decode step for each token it fed (all
    but the last)."""
    prompts, width = mask.shape
    prefill = recorder.call(0).view(prompts, width, recorder.routers.num_layers, -1).numpy()
    calls = range(1, len(recorder.calls))
    steps = np.stack([recorder.call(c).numpy() for c in calls]) if calls else None  # [steps, rows, layers, k]
    kept = [prefill[p][mask[p].bool().cpu().numpy()] for p in range(prompts)]

    def route(row: int, length: int) -> np.ndarray:
        prompt = kept[row // n]
        return np.concatenate([prompt, steps[: length - 1, row]]) if length > 1 else prompt.copy()

    return route


@functools.lru_cache(maxsize=16)
def stop_candidates(tokenizer, strings: tuple[str, ...], vocab_size: int) -> torch.Tensor:
    """`StopStrings.candidates_of`, once per tokenizer and set of strings."""
    return StopStrings.candidates_of(tokenizer, strings, vocab_size)

"""Rollout engines: what generates the responses, in a process of its own, fed weights through `weight_sync`.

`RolloutEngine` is the interface the trainer uses. `ProcessEngine` runs a worker in a process of its own that holds its
own copy of the model: `HFWorker` (Hugging Face `generate`, CPU or GPU, weights over gloo) or `VllmWorker` (vLLM,
GPU, weights over NCCL; `vllm_engine.py`). Every completion says which weight version produced it, so the trainer
never trains on rollouts of stale weights.
"""

import hashlib
import multiprocessing as mp
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from lorarl.trainer.decode import decode
from lorarl.trainer.errors import TrainerError
from lorarl.weight_sync import (
    BucketReceiver,
    BucketSender,
    SyncStats,
    TensorSpec,
    copy_into,
    create_sync_group,
    free_port,
)
from lorarl.weight_sync.vllm import save_adapter


@dataclass(frozen=True)
class Completion:
    prompt_index: int
    token_ids: tuple[int, ...]  # the response, with the end-of-sequence token when it stopped on it
    logprobs: tuple[float, ...]  # the engine's log-probs of those tokens (its sampling distribution)
    finished: bool  # stopped on end-of-sequence (False: cut at max_tokens)
    version: int  # weights that produced it


class RolloutEngine(Protocol):
    version: int

    def generate(
        self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> list[Completion]: ...

    def submit(
        self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> Callable[[], list[Completion]]:
        """`generate` started in the background: returns what waits for its completions (called before any other
        request to the engine)."""
        ...

    def sync_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, manifest: Sequence[TensorSpec | tuple]
    ) -> SyncStats: ...

    def sync_adapter(self, tensors: dict[str, torch.Tensor], config: dict, *, version: int) -> SyncStats: ...

    def weights_checksum(self) -> str: ...

    def close(self) -> None: ...


class EngineError(TrainerError):
    """The rollout engine failed (its own traceback is in the message) or died."""


def agreed(values: list, what: str):
    """The one value that every worker of an engine (or every replica) reports as `what`."""
    if len(set(values)) != 1:
        raise EngineError(f"the rollout workers disagree on their {what}: {values}")
    return values[0]


def expect_version(reported: int, version: int, what: str) -> int:
    """The version an engine reports after `what`, which must be the version sent."""
    if reported != version:
        raise EngineError(f"the engine reports version {reported} after {what} of version {version}")
    return reported


def hf_settings(model_path: Path | str, *, dtype: torch.dtype, device: str, eos_token_id: int, pad_token_id: int,
                batch_size: int, timeout: float = 600.0, threads: int | None = None) -> dict:  # fmt: skip
    """What an HF rollout worker needs to build its model and generate (plain data: it crosses process bounds).
    `threads`: torch's CPU threads in the worker (None: torch's default)."""
    return {"kind": "hf", "model_path": str(model_path), "dtype": dtype, "device": device, "eos": eos_token_id,
            "pad": pad_token_id, "batch_size": batch_size, "timeout": timeout, "threads": threads,
            "sync_backend": "gloo", "sync_ranks": 1}  # fmt: skip


def sync_sender(group, settings: dict, bucket_bytes: int) -> BucketSender:
    """The trainer's end of a sync group: NCCL sends from the GPU, gloo from the CPU."""
    nccl = settings["sync_backend"] == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return BucketSender(group, bucket_bytes=bucket_bytes, device=device, timeout=settings["timeout"])


class ProcessEngine:
    """A rollout worker (`settings["kind"]`: hf or vllm) in a process of its own, fed weights over a sync group."""

    def __init__(self, settings: dict, *, bucket_bytes: int):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        port = free_port()
        name = f"lorarl-{settings['kind']}-engine"
        self.process = ctx.Process(target=_serve, args=(child, settings, port), daemon=True, name=name)
        self.process.start()
        self.timeout = timeout = settings["timeout"]
        world = 1 + settings["sync_ranks"]
        group = create_sync_group("127.0.0.1", port, world, 0, backend=settings["sync_backend"], timeout=timeout)
        self.sender = sync_sender(group, settings, bucket_bytes)
        self.version = self._reply("start")

    def generate(
        self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> list[Completion]:
        return self.submit(prompts, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)()

    def submit(
        self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> Callable[[], list[Completion]]:
        self._conn.send(("generate", ([list(p) for p in prompts], n, temperature, top_p, max_tokens, seed)))
        return lambda: self._reply("generate")

    def sync_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, manifest: Sequence[TensorSpec | tuple]
    ) -> SyncStats:
        return self._sync(
            "receive", lambda: self.sender.send(named_tensors, version=version, manifest=manifest), version
        )

    def sync_adapter(self, tensors: dict[str, torch.Tensor], config: dict, *, version: int) -> SyncStats:
        return self._sync(
            "receive_adapter", lambda: self.sender.send_adapter(tensors, config, version=version), version
        )

    def _sync(self, command: str, send, version: int) -> SyncStats:
        """The worker starts `command` (its end of the transfer), this side sends; then the worker's version."""
        self._conn.send((command, ()))
        stats = send()
        self.version = expect_version(self._reply(command), version, command)
        return stats

    def weights_checksum(self) -> str:
        self._conn.send(("checksum", ()))
        return self._reply("checksum")

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("close", ()))
                self.process.join(timeout=10)
            except (BrokenPipeError, OSError):
                pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def _reply(self, what: str):
        if not self._conn.poll(self.timeout):
            raise EngineError(f"the rollout engine did not answer {what!r} within {self.timeout:g} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise EngineError(f"the rollout engine died during {what!r} (exit code {self.process.exitcode})") from None
        if status == "error":
            raise EngineError(f"the rollout engine failed during {what!r}:\n{value}")
        return value


# --- the worker ----------------------------------------------------------------------------------------------------


def worker_class(kind: str) -> type:
    """The worker of an engine kind (`rollout.engine`); vLLM is imported only when asked for."""
    if kind == "vllm":
        from lorarl.trainer.vllm_engine import VllmWorker

        return VllmWorker
    return HFWorker


class HFWorker:
    """What an HF rollout engine process (or Ray actor) holds: the model, and its end of the weight-sync group."""

    def __init__(self, settings: dict):
        from transformers import AutoModelForCausalLM

        self.settings = settings
        if settings["threads"]:
            torch.set_num_threads(settings["threads"])
        model = AutoModelForCausalLM.from_pretrained(settings["model_path"], dtype=settings["dtype"])
        self.model = model.to(settings["device"]).eval()
        self.version = 0  # the weights from disk
        self.receiver: BucketReceiver | None = None
        self.adapter = None  # a peft model around self.model while an adapter is served unmerged

    def join(self, host: str, port: int, world_size: int, rank: int) -> int:
        timeout = self.settings["timeout"]
        group = create_sync_group(host, port, world_size, rank, timeout=timeout)
        self.receiver = BucketReceiver(group, timeout=timeout)
        return self.version

    def generate(self, prompts, n, temperature, top_p, max_tokens, seed) -> list[Completion]:
        model = self.adapter if self.adapter is not None else self.model
        return _generate(model, self.settings, self.version, prompts, n, temperature, top_p, max_tokens, seed)

    def receive(self) -> int:
        """Merged weights: into the plain model (an adapter served so far is dropped first)."""
        self.drop_adapter()
        self.version = self.receiver.load_into(self.model)
        return self.version

    def drop_adapter(self) -> None:
        if self.adapter is not None:
            self.model, self.adapter = self.adapter.unload(), None  # the LoRA layers out, the base as it was

    def receive_adapter(self) -> int:
        """A LoRA adapter, served unmerged by peft on the weights this worker holds (`rollout.sync=adapter`)."""
        return self.serve_adapter(*self.receiver.receive_adapter())

    def serve_adapter(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> int:
        from peft import PeftModel, set_peft_model_state_dict

        if self.adapter is None:
            with tempfile.TemporaryDirectory() as directory:
                save_adapter(tensors, config, Path(directory))
                self.adapter = PeftModel.from_pretrained(self.model, directory).eval()
        else:
            set_peft_model_state_dict(self.adapter, tensors)
        self.version = version
        return version

    def checksum(self) -> str:
        return _checksum(self.model)


class InlineEngine:
    """The HF worker in the trainer's own process (`rollout.worker=inline`): no second process holding its own torch
    and transformers, no wire — merged weights are copied from the stream straight into its model, with the
    receiver's checks (`weight_sync.copy_into`). It generates when asked, so nothing overlaps with training."""

    def __init__(self, settings: dict):
        self.worker = HFWorker(settings)
        self.version = self.worker.version

    def generate(
        self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> list[Completion]:
        return self.worker.generate([list(p) for p in prompts], n, temperature, top_p, max_tokens, seed)

    def submit(
        self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> Callable[[], list[Completion]]:
        completions = self.generate(prompts, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                    seed=seed)  # fmt: skip
        return lambda: completions

    def sync_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, manifest: Sequence[TensorSpec | tuple]
    ) -> SyncStats:
        self.worker.drop_adapter()
        stats = copy_into(self.worker.model, named_tensors, version=version, manifest=manifest)
        self.version = self.worker.version = version
        return stats

    def sync_adapter(self, tensors: dict[str, torch.Tensor], config: dict, *, version: int) -> SyncStats:
        started = time.perf_counter()
        owned = {name: tensor.detach().clone() for name, tensor in tensors.items()}  # the trainer trains its own on
        self.version = self.worker.serve_adapter(owned, config, version)
        return SyncStats(version, len(owned), sum(t.nbytes for t in owned.values()), 0, time.perf_counter() - started)

    def weights_checksum(self) -> str:
        return self.worker.checksum()

    def close(self) -> None:
        """Nothing to stop: the model goes with the engine."""


def _serve(conn, settings: dict, port: int) -> None:
    try:
        worker = worker_class(settings["kind"])(settings)
        conn.send(("ok", worker.join("127.0.0.1", port, 1 + settings["sync_ranks"], 1)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    commands = {"generate": worker.generate, "receive": worker.receive, "receive_adapter": worker.receive_adapter,
                "checksum": worker.checksum}  # fmt: skip
    while True:
        command, args = conn.recv()
        if command == "close":
            return
        try:
            if command not in commands:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", commands[command](*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _generate(model, settings, version, prompts, n, temperature, top_p, max_tokens, seed) -> list[Completion]:
    """Sample `n` responses per prompt (greedy when temperature is 0), batched, seeded: the same call, the same
    samples (what makes a resumed run repeat an uninterrupted one)."""
    eos, pad, device = settings["eos"], settings["pad"], settings["device"]
    generator = torch.Generator(device=device).manual_seed(seed)
    completions = []
    per_batch = max(1, settings["batch_size"] // n)
    for start in range(0, len(prompts), per_batch):
        chunk = prompts[start : start + per_batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        tokens, logp = decode(model, ids, mask, n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              eos=eos, pad=pad, generator=generator)  # fmt: skip
        for row, (row_tokens, row_logp) in enumerate(zip(tokens.tolist(), logp.tolist(), strict=True)):
            finished = eos in row_tokens
            length = row_tokens.index(eos) + 1 if finished else len(row_tokens)
            completions.append(Completion(start + row // n, tuple(row_tokens[:length]), tuple(row_logp[:length]),
                                          finished, version))  # fmt: skip
    return completions


def _checksum(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()

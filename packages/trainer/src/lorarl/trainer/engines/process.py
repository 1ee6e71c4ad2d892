"""The process placement (`rollout.worker=process`): the worker in a process of its own holding its own copy of the
model, fed weights over a sync group (gloo from the CPU, NCCL from the GPU) and driven over a pipe. It generates
beside the trainer (`submit` returns at once), which `rollout.overlap` uses."""

import contextlib
import dataclasses
import multiprocessing as mp
import threading
import traceback
from collections.abc import Callable, Sequence

import torch

from lorarl.trainer.engines.base import Capabilities, Completion, EngineError, Sampling, SubmitsInBackground
from lorarl.trainer.interrupt import ignore_stop_signals
from lorarl.trainer.registry import Portable
from lorarl.weight_sync import Channel, Link, SyncStats, TransferError, Update, free_port, open_channel
from lorarl.weight_sync.factors import narrowed_base


def open_sender(host: str, port: int, world: int, settings, bucket_bytes: int, failed: Callable[[], str | None]):
    """The trainer's end (rank 0) of the channel its engine joins as it starts: a sync group (NCCL sends from the
    GPU, gloo from the CPU; every bucket checksummed). `failed()` says why the engine side cannot join (or None):
    checked while waiting, so a worker that fails to start raises at once instead of leaving this side waiting out
    the group's timeout (the abandoned rendezvous ends at it, in a daemon thread)."""
    outcome: list = []
    nccl = settings.sync_backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    link = Link(host, port, world - 1, settings.timeout)

    def join() -> None:
        try:
            outcome.append(open_channel(settings.sync_backend, link, 0, device=device, bucket_bytes=bucket_bytes))
        except Exception as error:
            outcome.append(error)

    joining = threading.Thread(target=join, daemon=True, name="lorarl-sync-join")
    joining.start()
    while joining.is_alive():
        joining.join(timeout=0.5)
        reason = None if outcome else failed()
        if reason:
            raise EngineError(f"the rollout engine could not start:\n{reason}")
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


class FedOverChannel:
    """The syncs of an engine fed over a channel (`channel`, the trainer's end): each one the workers' `receive` —
    their end of the transfer — while this side sends (`_sync`, the placement's own)."""

    channel: Channel
    dtype: torch.dtype  # the engine's: a factor set's base weights cross narrowed to it where exact

    def sync(self, update: Update) -> SyncStats:
        if update.form == "factors":
            update = dataclasses.replace(update, tensors=narrowed_base(update.tensors, self.dtype))
        return self._sync(update.form, update.version, lambda: self.channel.send(update))

    def _sync(self, form: str, version: int, send: Callable[[], SyncStats]) -> SyncStats:
        raise NotImplementedError


class ProcessEngine(SubmitsInBackground, FedOverChannel):
    """A worker in a process of its own (spawned: the worker's class and settings reach it as `Portable`, so a
    plugin engine from a file loads there as it did here)."""

    def __init__(self, worker_class: type, settings, *, bucket_bytes: int):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        port = free_port()
        name = f"lorarl-{worker_class.__name__}"
        self.process = ctx.Process(
            target=_serve, args=(child, Portable((worker_class, settings)), port), daemon=True, name=name
        )
        self.process.start()
        self.timeout, self.dtype = settings.timeout, settings.dtype
        self._early: tuple | None = None  # the worker's first answer, if it came while this side joined
        self.channel = open_sender("127.0.0.1", port, 1 + settings.sync_ranks, settings, bucket_bytes,
                                   self._failed_to_start)  # fmt: skip
        self.capabilities = Capabilities(background=True, checksum=worker_class.capabilities.checksum)
        self.version = self._reply("start")

    def submit(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> Callable[[], list[Completion]]:
        self._conn.send(("generate", ([list(p) for p in prompts], sampling)))
        return lambda: self._reply("generate")

    def _sync(self, form: str, version: int, send) -> SyncStats:
        """The worker starts receiving (its end of the transfer of `version`), this side sends; then the worker's
        version. If sending fails, the worker's own error (it failed first, or with it) is the one raised."""
        self._conn.send(("receive", (form, version)))
        try:
            stats = send()
        except TransferError as error:
            self._reply(f"receive {form}")  # raises the worker's error, if it has one
            raise error
        self.version = self._reply(f"receive {form}")
        return stats

    def checksum(self) -> str:
        self._conn.send(("checksum", ()))
        return self._reply("checksum")

    def sleep(self) -> None:
        """Nothing to free: a process of its own holds its own device."""

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

    def _failed_to_start(self) -> str | None:
        if self._early is None and self._conn.poll():
            with contextlib.suppress(EOFError):
                self._early = self._conn.recv()
        if self._early is not None and self._early[0] == "error":
            return self._early[1]
        if not self.process.is_alive():
            return f"its process died (exit code {self.process.exitcode})"
        return None

    def _reply(self, what: str):
        if self._early is not None:
            (status, value), self._early = self._early, None
            if status == "error":
                raise EngineError(f"the rollout engine failed during {what!r}:\n{value}")
            return value
        if not self._conn.poll(self.timeout):
            raise EngineError(f"the rollout engine did not answer {what!r} within {self.timeout:g} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise EngineError(f"the rollout engine died during {what!r} (exit code {self.process.exitcode})") from None
        if status == "error":
            raise EngineError(f"the rollout engine failed during {what!r}:\n{value}")
        return value


def _serve(conn, portable: Portable, port: int) -> None:
    """The engine process: build the worker, join the sync group, then answer commands until "close" (or until the
    trainer is gone). A signal to the process group is the trainer's to handle: it closes the engine when it stops."""
    ignore_stop_signals()
    worker_class, settings = portable.value
    try:
        worker = worker_class(settings)
        conn.send(("ok", worker.join("127.0.0.1", port, 1 + settings.sync_ranks, 1)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    commands = {"generate": worker.generate, "receive": worker.receive, "checksum": worker.checksum}
    while True:
        try:
            command, args = conn.recv()
        except EOFError:  # the trainer died
            command = "close"
        if command == "close":
            worker.close()
            return
        try:
            if command not in commands:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", commands[command](*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))

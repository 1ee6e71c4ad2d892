"""vLLM integration: a worker extension that receives weights through a lorarl sync group, and its trainer-side driver.

    llm = LLM(model=path, worker_extension_cls="lorarl.weight_sync.vllm.WeightSyncWorkerExtension", ...)
    sync = VllmWeightSync(llm, backend="nccl")           # the trainer is rank 0, every vLLM worker joins
    sync.send(iter_merged_weights(model), version=step, manifest=merged_weight_specs(model))

Every worker (each tensor-parallel rank of every engine) receives the full tensors and hands them to its model's
`load_weights`, which shards them; then vLLM's post-load processing runs (repacking, quantization). A colocated
engine is handed the tensors directly when its worker shares the trainer's process (`lorarl_load_weights`), or as
shared buckets (CUDA IPC, `lorarl.weight_sync.shared`) when its tensor-parallel workers are processes of their own
on the trainer's GPUs (`lorarl_join_mailbox`, `lorarl_load_from_mailbox`). Importing this module does
not import vLLM; the extension's methods do, inside the worker.
"""

import concurrent.futures
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from lorarl.weight_sync.adapter_dir import save_adapter
from lorarl.weight_sync.group import create_sync_group, free_port
from lorarl.weight_sync.protocol import TensorSpec, TransferError
from lorarl.weight_sync.receiver import BucketReceiver
from lorarl.weight_sync.sender import DEFAULT_BUCKET_BYTES, BucketSender, SyncStats
from lorarl.weight_sync.shared import BucketMailbox


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`): uses the worker's `model_runner` and `device`."""

    def lorarl_sync_rank(self, rank_offset: int) -> int:
        """This worker's rank in the sync group: its rank among the engine's workers, after the trainer's."""
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().rank + rank_offset

    def lorarl_join_sync_group(
        self, host: str, port: int, world_size: int, rank_offset: int, backend: str = "nccl", timeout: float = 300.0
    ) -> int:
        rank = self.lorarl_sync_rank(rank_offset)
        group = create_sync_group(host, port, world_size, rank, backend=backend, timeout=timeout)
        device = self.device if backend == "nccl" else "cpu"
        self._lorarl_receiver = BucketReceiver(group, src=0, device=device, timeout=timeout)
        return rank

    def lorarl_receive_weights(self) -> int:
        """Receive one version of the weights into the model; returns the version (all-or-error, see load_into)."""
        model = self.model_runner.model
        version = self._lorarl_receiver.load_into(model)
        finish_loading(model, self.model_runner.model_config, self.device)
        return version

    def lorarl_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        """Load weights handed over inside this process — a colocated engine, whose worker shares the trainer's
        process and GPU, needs no transfer — then vLLM's post-load processing. Returns (tensors, bytes) loaded."""
        counts = [0, 0]

        def counted():
            for name, tensor in named_tensors:
                counts[0] += 1
                counts[1] += tensor.numel() * tensor.element_size()
                yield name, tensor

        model = self.model_runner.model
        model.load_weights(counted())
        finish_loading(model, self.model_runner.model_config, self.device)
        return counts[0], counts[1]

    def lorarl_join_mailbox(self, host: str, port: int, consumers: int, timeout: float = 300.0) -> int:
        """Join a colocated trainer's `BucketMailbox` (tensor-parallel workers are processes of their own on the
        trainer's GPUs: they read its buckets through CUDA IPC). Returns this worker's consumer rank."""
        rank = self.lorarl_sync_rank(1)
        self._lorarl_mailbox = BucketMailbox(host, port, rank=rank, consumers=consumers, timeout=timeout)
        return rank

    def lorarl_load_from_mailbox(self) -> tuple[int, int, int]:
        """Load one transfer posted to the mailbox — all its buckets in one `load_weights` call, each tensor copied
        onto this worker's device — then vLLM's post-load processing. Returns `(version, tensors, bytes)`."""
        tensors, nbytes = self.lorarl_load_weights(self._lorarl_mailbox.receive(self.device))
        return self._lorarl_mailbox.version, tensors, nbytes

    def lorarl_receive_adapter(self, directory: str) -> tuple[int, str]:
        """Receive a LoRA adapter and write it as a peft adapter directory (for a `LoRARequest`); every worker takes
        part in the transfer, the engine's first worker writes the files. Returns `(version, directory)`."""
        tensors, config, version = self._lorarl_receiver.receive_adapter()
        from vllm.distributed.parallel_state import get_world_group

        if get_world_group().rank == 0:
            save_adapter(tensors, config, Path(directory) / f"v{version}")
        return version, str(Path(directory) / f"v{version}")


def finish_loading(model: torch.nn.Module, model_config: object, device: torch.device) -> None:
    """vLLM's post-load processing (repacks fused/quantized weights after `load_weights`)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    process_weights_after_loading(model, model_config, device)


class VllmWeightSync:
    """Trainer side: join a sync group with every worker of a vLLM `LLM` built with `WeightSyncWorkerExtension`, then
    send weight versions to them (the workers are driven by `LLM.collective_rpc` while this process sends)."""

    def __init__(
        self,
        llm: object,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        backend: str = "nccl",
        timeout: float = 300.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        self.llm = llm
        self.workers = len(llm.collective_rpc("lorarl_sync_rank", args=(1,)))
        port = port or free_port(host)
        args = (host, port, self.workers + 1, 1, backend, timeout)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorarl-vllm-rpc")
        joining = self._pool.submit(llm.collective_rpc, "lorarl_join_sync_group", args=args)
        group = create_sync_group(host, port, self.workers + 1, 0, backend=backend, timeout=timeout)
        joining.result(timeout=timeout)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.sender = BucketSender(group, src=0, bucket_bytes=bucket_bytes, device=device, timeout=timeout)

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        version: int,
        manifest: Sequence[TensorSpec | tuple] | None = None,
    ) -> SyncStats:
        """Send a version of the full weights; returns once every worker loaded it (or raises)."""
        receiving = self._pool.submit(self.llm.collective_rpc, "lorarl_receive_weights")
        stats = self._send(receiving, lambda: self.sender.send(named_tensors, version=version, manifest=manifest))
        _check_versions(receiving.result(), version)
        return stats

    def send_adapter(
        self, tensors: Mapping[str, torch.Tensor], config: dict, *, version: int, directory: str
    ) -> tuple[SyncStats, str]:
        """Send a LoRA adapter; returns the stats and the adapter directory for a `vllm.lora.request.LoRARequest`."""
        receiving = self._pool.submit(self.llm.collective_rpc, "lorarl_receive_adapter", args=(directory,))
        stats = self._send(receiving, lambda: self.sender.send_adapter(tensors, config, version=version))
        results = receiving.result()
        _check_versions([v for v, _ in results], version)
        return stats, results[0][1]

    def _send(self, receiving: concurrent.futures.Future, send) -> SyncStats:
        try:
            return send()
        except TransferError:
            receiving.exception(timeout=self.sender.channel.timeout)  # let the workers' side finish, then report
            raise


def _check_versions(versions: list[int], version: int) -> None:
    if any(v != version for v in versions):
        raise TransferError(f"vLLM workers report versions {versions} after sending version {version}")

"""Data-parallel training across trainer ranks started by `torchrun` (one process per GPU; gloo ranks on CPU).

The policy is sharded with FSDP2 (`fully_shard`: one unit per decoder layer, then the root), so the frozen base and
the LoRA parameters are spread over the ranks. Rank 0 owns the rollout engine: it generates and scores, then
broadcasts the samples; every rank trains on its slice of each mini-batch. Losses use whole-mini-batch denominators
and the gradients are summed across ranks (losses scaled by N against FSDP's average), so N ranks make the update
one rank makes on the same batch. Every forward pass is a collective under FSDP, so ranks always run the same
number of micro-batches (a rank with nothing left runs one with zero weight).
"""

import os
import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from lorarl.weight_sync.group import is_loopback, rendezvous_store


@dataclass
class DataParallel:
    rank: int
    world: int
    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    device: torch.device  # this rank's device, where collectives run

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rows(self, indices: list[int], rank: int) -> list[int]:
        """Rank `rank`'s share of `indices` (strided, so lengths stay balanced)."""
        return indices[rank :: self.world]

    def broadcast(self, value):
        """Rank 0's `value`, on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the ranks, on `tensor`'s device. The reduction runs on the mesh's device: NCCL
        has no CPU tensors, and metrics are gathered on the CPU."""
        summed = tensor.to(self.device, copy=True)
        dist.all_reduce(summed)
        return summed.to(tensor.device)

    def sum_metrics(self, values: dict[str, float]) -> dict[str, float]:
        """Per-key sums over the ranks (every rank reports the same keys, possibly 0)."""
        keys = sorted(self.broadcast(sorted(values)))
        totals = self.sum(torch.tensor([values.get(k, 0.0) for k in keys], dtype=torch.float64))
        return dict(zip(keys, totals.tolist(), strict=True))


def setup_data_parallel(device: torch.device) -> tuple[DataParallel | None, torch.device]:
    """Join the ranks `torchrun` started (it sets WORLD_SIZE; one rank too takes this path, sharded over itself): NCCL
    on GPU, gloo on CPU. Returns (None, device) when not started by torchrun."""
    if "WORLD_SIZE" not in os.environ:
        return None, device
    world = int(os.environ["WORLD_SIZE"])
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        _join(world, "nccl" if device.type == "cuda" else "gloo")
    return DataParallel(dist.get_rank(), world, init_device_mesh(device.type, (world,)), device), device


def _join(world: int, backend: str) -> None:
    """The default group, listening on loopback alone where every rank is on this machine (torchrun on one node, a
    local Ray cluster): the store rank 0 hosts (torchrun's agent hosts its own) and gloo's pairs."""
    host, rank = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("RANK", "0"))
    local = is_loopback(host) or os.environ.get("LOCAL_WORLD_SIZE") == str(world)
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if local and backend == "gloo" and loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    if is_loopback(host) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        store = rendezvous_store(host, int(os.environ["MASTER_PORT"]), world, rank, timedelta(minutes=30))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend)


def shard(model: nn.Module, mesh) -> None:
    """FSDP2 over the mesh: each decoder layer (the classes the model lists in `_no_split_modules`), then the root.
    FSDP averages gradients over the ranks: the trainer scales its losses by the world size to sum them."""
    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns at every forward that the wrapped peft model returns a view (an in-place op on it would skip FSDP's
    # backward hook): lorarl's losses make none (two ranks make the update of one: test_data_parallel)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    layer_classes = set()
    for module in model.modules():
        layer_classes.update(getattr(module, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gathered copies of a (possibly sharded) state dict, on the CPU; a collective: every rank calls it."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in state.items()}


def gathered_trainable(model: torch.nn.Module, is_lora: bool) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of a sharded model (its trainable weights, or all of a full fine-tune), gathered."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return full_state_dict({k: v for k, v in model.state_dict().items() if k in trainable or not is_lora})

"""Ranks of the FSDP2 tests: a tiny LoRA Qwen2 sharded with `fully_shard` over gloo on CPU."""

import torch.distributed as dist
from sync_e2e_workers import fingerprint
from tiny_models import tiny_lora_qwen2

from lorarl.lora_merge import iter_merged_weights, merged_weight_specs


def shard(model, mesh) -> list:
    """FSDP2 the way a trainer does it: one unit per decoder layer, the root (embeddings, norm, head) on top."""
    from torch.distributed.fsdp import fully_shard

    layers = list(model.base_model.model.model.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return layers


def gathered_layers(layers) -> int:
    from torch.distributed.tensor import DTensor

    return sum(not any(isinstance(p, DTensor) for p in layer.parameters()) for layer in layers)


def local_shards(model) -> dict[str, str]:
    return fingerprint({name: p.detach().to_local().contiguous() for name, p in model.named_parameters()})


def merged_under_fsdp(port: int, rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = tiny_lora_qwen2()
        layers = shard(model, init_device_mesh("cpu", (2,)))
        before = local_shards(model)
        specs = [(name, tuple(shape), str(dtype)) for name, shape, dtype in merged_weight_specs(model)]
        merged, most_gathered = {}, 0
        for name, tensor in iter_merged_weights(model):
            most_gathered = max(most_gathered, gathered_layers(layers))
            merged[name] = tensor
        yielded = [(name, tuple(t.shape), str(t.dtype)) for name, t in merged.items()]
        return {"merged": fingerprint(merged), "specs": specs, "yielded": yielded, "most_gathered": most_gathered,
                "gathered_after": gathered_layers(layers), "unchanged": local_shards(model) == before}  # fmt: skip
    finally:
        dist.destroy_process_group()

"""The trainer's data-parallel ranks as Ray actors (`trainer.backend=ray` with `trainer.n_gpus_per_node` x
`trainer.nnodes` > 1): one actor per rank (one GPU each on GPU), in a placement group; they form their
torch.distributed group from rank 0's address and run the same `Trainer` as `torchrun` would start (FSDP2, see
`parallel.py`). Rank 0 reports, starts the rollout engines (Ray actors too) and writes the outputs."""

import os

from lorarl.trainer.config import Config
from lorarl.trainer.engines.ray_actors import connect
from lorarl.weight_sync import free_port


class TrainerRank:
    """One data-parallel rank of the trainer, inside a Ray actor."""

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def run(self, config: Config, rank: int, world: int, master: tuple[str, int]) -> dict:
        import torch.distributed as dist
        from rich.console import Console

        from lorarl.trainer.loop import Trainer

        # Ray shows each actor its own GPU (as device 0)
        os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR=master[0],
                          MASTER_PORT=str(master[1]))  # fmt: skip
        try:
            console = Console(highlight=False, soft_wrap=True) if rank == 0 else None
            return Trainer(config, console=console).run()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def run_on_ray(config: Config) -> dict:
    """Run the training with its ranks as Ray actors; returns rank 0's summary."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    t = config.trainer
    world = t.n_gpus_per_node * t.nnodes
    started = connect(t.ray_address, cpus=world + config.rollout.replicas + 1)
    try:
        gpu = t.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
        bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
        group = placement_group([bundle] * world, strategy="PACK")
        ray.get(group.ready(), timeout=600)
        actor = ray.remote(TrainerRank)
        placed = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i) for i in range(world)]
        ranks = [actor.options(num_cpus=1, num_gpus=1 if gpu else 0, scheduling_strategy=where).remote()
                 for where in placed]  # fmt: skip
        master = ray.get(ranks[0].address.remote())
        summaries = ray.get([r.run.remote(config, i, world, master) for i, r in enumerate(ranks)])
        remove_placement_group(group)
        return summaries[0]
    finally:
        if started:
            ray.shutdown()

"""The Ray placement (`trainer.backend=ray`): `rollout.replicas` workers (HF or vLLM) in a placement
group, the prompts spread across them, the weights broadcast to all of them at once over one sync group (the trainer
is rank 0, then each replica's ranks: one per HF worker, one per tensor-parallel vLLM worker). Ray places the actors,
on this machine or across a cluster (`trainer.ray_address`)."""

import dataclasses
import os
from collections.abc import Callable, Sequence

from lorarl.trainer.engines.base import (
    Capabilities,
    Completion,
    EngineError,
    Sampling,
    SamplingParams,
    SubmitsInBackground,
    agreed,
)
from lorarl.trainer.engines.process import FedOverChannel, open_sender
from lorarl.trainer.registry import plugin_modules
from lorarl.weight_sync import SyncStats, free_port

# Under `uv run`, Ray's hook would rebuild this uv environment inside every worker (about a minute each, here): the
# workers run this interpreter instead. Read when Ray is imported (lazily, below); =1 brings the hook back.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def connect(address: str | None, *, cpus: int) -> bool:
    """Join the Ray cluster at `address`, or start a local Ray with at least `cpus` logical CPUs (so that every
    actor gets its bundle even on a small machine). Returns whether this call started Ray (then it shuts it down)."""
    import ray
    from ray._private import ray_constants

    # Ray reads this once, when first imported — possibly before this module set it (vLLM imports Ray): again, then
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = ray_constants.env_bool("RAY_ENABLE_UV_RUN_RUNTIME_ENV", True)
    if ray.is_initialized():  # e.g. inside a trainer rank that is itself a Ray actor
        return False
    if address:
        ray.init(address=address, include_dashboard=False)
        return True
    # a cluster of this machine alone listens on loopback (Ray authenticates no one): what Ray does where it takes
    # clusters to be off, its node's address loopback; in its processes and, read at import, in this one
    os.environ.setdefault(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")
    ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, True)
    ray.init(num_cpus=max(os.cpu_count() or 1, cpus), include_dashboard=False)
    return True


class RayEngines(SubmitsInBackground, FedOverChannel):
    """The `RolloutEngine` interface over several worker actors."""

    def __init__(self, worker_class: type, settings, *, replicas: int, bucket_bytes: int, address: str | None = None):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.timeout, self.dtype = settings.timeout, settings.dtype
        self.started_ray = connect(address, cpus=replicas + 1)
        gpus = settings.sync_ranks if settings.device.startswith("cuda") else 0  # a vLLM replica: TP GPUs
        self.placement = placement_group([{"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}] * replicas, strategy="PACK")
        self._get(self.placement.ready(), f"placing {replicas} rollout replicas (not enough free resources?)")
        for module in plugin_modules():  # a plugin file, which the actors cannot import by name: its code goes along
            ray.cloudpickle.register_pickle_by_value(module)
        worker = ray.remote(worker_class)
        self.actors = [
            worker.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement, placement_group_bundle_index=i)).remote(settings)
            for i in range(replicas)
        ]  # fmt: skip
        ranks = settings.sync_ranks
        world = 1 + replicas * ranks
        host, port = ray.util.get_node_ip_address(), free_port()
        joined = [actor.join.remote(host, port, world, 1 + i * ranks) for i, actor in enumerate(self.actors)]
        try:
            self.channel = open_sender(host, port, world, settings, bucket_bytes, lambda: self._failed(joined))
        except BaseException:
            self.close()  # the actors, their placement and a Ray started here go too
            raise
        self.capabilities = Capabilities(background=True, checksum=worker_class.capabilities.checksum)
        self.version = agreed(self._get(joined, "start"), "weights version")

    def submit(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> Callable[[], list[Completion]]:
        """Contiguous slices of the prompts, one per replica (each seeded by `seed` and its index, or with its prompts'
        own settings), in order."""
        size = -(-len(prompts) // len(self.actors))
        starts = range(0, len(prompts), size)

        def part(i: int, start: int) -> Sampling:
            if isinstance(sampling, SamplingParams):
                return dataclasses.replace(sampling, seed=sampling.seed + 7919 * i)
            return list(sampling[start : start + size])

        futures = [actor.generate.remote([list(p) for p in prompts[start : start + size]], part(i, start))
                   for i, (actor, start) in enumerate(zip(self.actors, starts, strict=False))]  # fmt: skip

        def wait() -> list[Completion]:
            completions = []
            for start, part in zip(starts, self._get(futures, "generate"), strict=False):
                completions += [dataclasses.replace(c, prompt_index=c.prompt_index + start) for c in part]
            return completions

        return wait

    def _sync(self, form: str, version: int, send) -> SyncStats:
        """Every replica receives (its end of the transfer of `version`) while this side sends."""
        received = [actor.receive.remote(form, version) for actor in self.actors]
        stats = send()
        self.version = agreed(self._get(received, f"receive {form}"), f"version after receiving {form}")
        return stats

    def _failed(self, joined: list) -> str | None:
        """Why a replica could not join the sync group (it failed to start), or None."""
        import ray

        ready, _ = ray.wait(joined, num_returns=len(joined), timeout=0)
        for future in ready:
            try:
                ray.get(future)
            except ray.exceptions.RayError as e:
                return str(e)
        return None

    def sleep(self) -> None:
        """Nothing to free: the actors hold their own devices."""

    def checksum(self) -> str:
        return agreed(self._get([actor.checksum.remote() for actor in self.actors], "checksum"), "weights")

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        ray.util.remove_placement_group(self.placement)
        if self.started_ray:
            ray.shutdown()

    def _get(self, futures, what: str):
        import ray

        try:
            return ray.get(futures, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise EngineError(f"the rollout replicas did not answer {what!r} within {self.timeout:g} s") from None
        except ray.exceptions.RayError as e:
            raise EngineError(f"a rollout replica failed during {what!r}:\n{e}") from None

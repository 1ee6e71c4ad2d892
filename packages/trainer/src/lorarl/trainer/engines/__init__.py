"""Rollout engines: what generates the responses, and where it runs.

A *worker* is an engine implementation, registered by name — the choices of `rollout.engine`:
- `hf` (`hf.py`): a Hugging Face model with lorarl's decode loop, CPU or GPU;
- `vllm` (`vllm_worker.py`): vLLM, on GPUs or (its CPU build) the CPU; inline in `vllm_inline.py`.

A *placement* runs a worker: `inline.py` (in the trainer's process, `rollout.worker=inline`), `process.py` (a process
of its own, `rollout.worker=process`, or a vLLM engine on `rollout.devices`), `ray_actors.py` (Ray actors,
`trainer.backend=ray`, `rollout.replicas` of them). Adding an engine is one module with a `Worker` subclass and one
`@register_engine("name")` line; `start_engine` is the one place that maps the config to an engine.
"""

from lorarl.trainer.engines.base import (
    Capabilities,
    Completion,
    EngineContext,
    EngineError,
    RolloutEngine,
    Worker,
)
from lorarl.trainer.engines.hf import HFWorker
from lorarl.trainer.engines.vllm_worker import VllmWorker
from lorarl.trainer.registry import Registry

ENGINES: Registry[type[Worker]] = Registry("rollout engine")
register_engine = ENGINES.register
register_engine("hf")(HFWorker)
register_engine("vllm")(VllmWorker)


def placement(rollout, backend: str) -> str:
    """Where the configured engine runs: "ray" (trainer.backend=ray), "process" (rollout.worker=process, or a vLLM
    engine on GPUs of its own), or "inline"."""
    if backend == "ray":
        return "ray"
    return "process" if rollout.worker == "process" or rollout.devices is not None else "inline"


def start_engine(rollout, context: EngineContext, *, backend: str, ray_address: str | None = None) -> RolloutEngine:
    """The engine the `rollout` config section describes, started."""
    worker = ENGINES[rollout.engine]
    settings = worker.settings(rollout, context)
    bucket_bytes = rollout.bucket_mb << 20
    where = placement(rollout, backend)
    if where == "ray":
        from lorarl.trainer.engines.ray_actors import RayEngines

        return RayEngines(worker, settings, replicas=rollout.replicas, bucket_bytes=bucket_bytes, address=ray_address)
    if where == "process":
        from lorarl.trainer.engines.process import ProcessEngine

        return ProcessEngine(worker, settings, bucket_bytes=bucket_bytes)
    return worker.inline(settings, bucket_bytes=bucket_bytes)


__all__ = [
    "ENGINES", "Capabilities", "Completion", "EngineContext", "EngineError", "RolloutEngine", "Worker",
    "placement", "register_engine", "start_engine",
]  # fmt: skip

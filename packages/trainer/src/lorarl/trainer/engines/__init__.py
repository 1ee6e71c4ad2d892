"""Rollout engines: what generates the responses, and where it runs.

A *worker* is an engine implementation, registered by name with its own settings (`rollout.<name>.*`) — the choices
of `rollout.engine`:
- `hf` (`hf.py`): a Hugging Face model with lorarl's decode loop, CPU or GPU;
- `vllm` (`vllm_worker.py`): vLLM, on GPUs or (its CPU build) the CPU;
- a plugin's: `rollout.engine=package.module:Name` or `path/to/file.py:Name`, a `Worker` subclass decorated with
  `@register_engine("name", settings=...)`.

A *placement* runs a worker: `inline.py` (in the trainer's process, `rollout.worker=inline`), `process.py` (a process
of its own, `rollout.worker=process`, or a vLLM engine on `rollout.vllm.devices`), `ray_actors.py` (Ray actors,
`trainer.backend=ray`, `rollout.replicas` of them). `placement` chooses, `start_engine` starts: the one place that maps
the config to an engine. The contract is `base.py`.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

from lorarl.trainer.engines.base import (
    ENGINES,
    GREEDY,
    Capabilities,
    Completion,
    Engine,
    EngineContext,
    EngineError,
    RolloutEngine,
    SamplingParams,
    Worker,
    WorkerSettings,
    register_engine,
)
from lorarl.trainer.registry import option


@dataclass
class HFEngineSettings:
    batch_size: int = option(256, "sequences generated at once", minimum=1)


@dataclass
class VllmEngineSettings:
    tensor_parallel_size: int = option(1, "GPUs per engine (its workers shard the received weights)", minimum=1)
    gpu_memory_utilization: float = option(0.5, "share of each engine GPU vLLM may use", minimum=0.05, maximum=1.0)
    max_model_len: int | None = option(None, "context length (None: the model's)")
    kv_cache_gb: float | None = option(None, "KV cache of an engine on the CPU, GiB (None: what a step's rollouts "
                                       "need, data.batch_size x rollout.n sequences of data.max_prompt_tokens + "
                                       "rollout.max_tokens tokens; on GPUs gpu_memory_utilization decides)",
                                       minimum=0.01)  # fmt: skip
    enforce_eager: bool | None = option(None, "without compiled graphs (None: eager on the CPU, where compiling takes "
                                        "minutes; graphs on GPUs)")  # fmt: skip
    devices: str | None = option(None, "GPUs of a local engine (CUDA_VISIBLE_DEVICES; it then runs in a process of "
                                 "its own); None = the trainer's")  # fmt: skip


register_engine("hf", settings=HFEngineSettings, about="a Hugging Face model with lorarl's decode loop, CPU or GPU")(
    "lorarl.trainer.engines.hf:HFWorker"
)
VLLM_INSTALL = (
    "on GPUs `uv sync --extra vllm` (or pip install 'lorarl-trainer[vllm]'); on the CPU, run from "
    "vLLM's CPU environment: scripts/vllm_cpu_env.sh, then .venv-vllm-cpu/bin/trainer ..."
)
register_engine("vllm", settings=VllmEngineSettings, about="vLLM, on GPUs or (its CPU build) the CPU",
                requires=("vllm", VLLM_INSTALL))("lorarl.trainer.engines.vllm_worker:VllmWorker")  # fmt: skip


def placement(rollout: Any, backend: str) -> str:
    """Where the configured engine runs: "ray" (trainer.backend=ray), "process" (rollout.worker=process, or an engine
    whose settings ask for devices of its own), or "inline"."""
    if backend == "ray":
        return "ray"
    engine = ENGINES[rollout.engine]
    if rollout.worker == "process" or engine.worker.needs_own_process(engine.settings_in(rollout)):
        return "process"
    return "inline"


def start_engine(
    rollout: Any, context: EngineContext, *, backend: str, ray_address: str | None = None
) -> RolloutEngine:
    """The engine the `rollout` config section describes, started, with the capabilities the config asks for."""
    engine = ENGINES[rollout.engine]
    worker = engine.worker
    where = placement(rollout, backend)
    bucket_bytes = rollout.bucket_mb << 20
    context = dataclasses.replace(context, inline=where == "inline", bucket_bytes=bucket_bytes)
    settings = worker.settings(engine.settings_in(rollout), context)
    if where == "ray":
        from lorarl.trainer.engines.ray_actors import RayEngines

        started = RayEngines(worker, settings, replicas=rollout.replicas, bucket_bytes=bucket_bytes,
                             address=ray_address)  # fmt: skip
    elif where == "process":
        from lorarl.trainer.engines.process import ProcessEngine

        started = ProcessEngine(worker, settings, bucket_bytes=bucket_bytes)
    else:
        from lorarl.trainer.engines.inline import InlineEngine

        started = InlineEngine(worker(settings))
    if rollout.overlap and not started.capabilities.background:
        started.close()
        raise EngineError(f"rollout.overlap needs an engine that generates in the background; {rollout.engine} "
                          f"placed {where} does not (rollout.worker=process does)")  # fmt: skip
    return started


__all__ = [
    "ENGINES", "GREEDY", "Capabilities", "Completion", "Engine", "EngineContext", "EngineError", "HFEngineSettings",
    "RolloutEngine", "SamplingParams", "VllmEngineSettings", "Worker", "WorkerSettings", "placement", "register_engine",
    "start_engine",
]  # fmt: skip

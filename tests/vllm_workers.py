"""Processes of the vLLM receiving tests: vLLM's own Qwen2 model class, built on CPU without an engine."""

import concurrent.futures
import tempfile
import types

import numpy as np
import torch
from tiny_models import tiny_lora_qwen2

from lorarl.lora_merge import iter_merged_weights, merged_weight_specs
from lorarl.weight_sync import BucketSender, create_sync_group
from lorarl.weight_sync.shared import BucketMailbox, share_buckets
from lorarl.weight_sync.vllm import VllmWeightSync, WeightSyncWorkerExtension


def vllm_worker(dist_port: int) -> WeightSyncWorkerExtension:
    """A vLLM worker as far as the extension sees it (`model_runner.model`, `model_runner.model_config`, `device`),
    holding vLLM's real Qwen2ForCausalLM for the tiny config, with vLLM's distributed state for one worker."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()  # vLLM's PyPI wheel has no CPU kernels, but builds models on CPU
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    config_dir = tempfile.mkdtemp()
    tiny_lora_qwen2().get_base_model().config.save_pretrained(config_dir)
    model_config = ModelConfig(model=config_dir, tokenizer=config_dir, skip_tokenizer_init=True, dtype="bfloat16")
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{dist_port}", backend="gloo"
        )
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)
        model = Qwen2ForCausalLM(vllm_config=vllm_config, prefix="")
        torch.set_default_dtype(torch.float32)

    class Worker(WeightSyncWorkerExtension):  # how vLLM mixes the extension into its worker class
        def __init__(self):
            self.model_runner = types.SimpleNamespace(model=model, model_config=model_config)
            self.device = torch.device("cpu")

    return Worker()


def plain(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Tensors as float32 numpy arrays (exact for bf16): safe to return from a process, unlike shared-memory tensors."""
    return {name: t.detach().float().numpy().copy() for name, t in tensors.items()}


def fused_reference(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM's fused layers must hold, from HF-named tensors."""
    out = {
        "model.embed_tokens.weight": state["model.embed_tokens.weight"],
        "model.norm.weight": state["model.norm.weight"],
    }
    for i in range(2):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[p + "self_attn.qkv_proj.bias"] = torch.cat([state[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
        out[p + "self_attn.o_proj.weight"] = state[p + "self_attn.o_proj.weight"]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]
        )
        out[p + "mlp.down_proj.weight"] = state[p + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + norm + ".weight"] = state[p + norm + ".weight"]
    return out


def trainer(port: int, rank: int):
    model = tiny_lora_qwen2()
    group = create_sync_group("127.0.0.1", port, 2, 0, timeout=60)
    BucketSender(group, bucket_bytes=16 << 10, direct_bytes=4096).send(
        iter_merged_weights(model), version=5, manifest=merged_weight_specs(model)
    )
    return plain(fused_reference(model.merge_and_unload().state_dict()))


def engine(port: int, rank: int, dist_port: int):
    worker = vllm_worker(dist_port)
    assert worker.lorarl_join_sync_group("127.0.0.1", port, 2, rank_offset=1, backend="gloo", timeout=60) == 1
    version = worker.lorarl_receive_weights()
    return version, plain(dict(worker.model_runner.model.named_parameters()))


def colocated(port: int, rank: int):
    """The colocated path: merged weights handed to the extension in its own process, no transfer."""
    model = tiny_lora_qwen2()
    worker = vllm_worker(port)
    loaded = worker.lorarl_load_weights(iter_merged_weights(model))
    expected = plain(fused_reference(model.merge_and_unload().state_dict()))
    return loaded, expected, plain(dict(worker.model_runner.model.named_parameters()))


def shared_trainer(port: int, rank: int):
    """A colocated trainer whose engine's workers are processes of their own: two versions of the merged weights
    posted as shared buckets (the second after a change to the adapter)."""
    model = tiny_lora_qwen2()
    mailbox = BucketMailbox("127.0.0.1", port, rank=0, consumers=1, timeout=60)
    posted = []
    for version in (6, 7):
        if version == 7:
            with torch.no_grad():
                next(p for n, p in model.named_parameters() if "lora_B" in n).add_(0.5)
        buckets = share_buckets(iter_merged_weights(model), version=version, device="cpu", bucket_bytes=16 << 10,
                                direct_bytes=4096, manifest=merged_weight_specs(model))  # fmt: skip
        posted.append(mailbox.post(buckets))
    return posted, plain(fused_reference(model.merge_and_unload().state_dict()))


def shared_engine(port: int, rank: int, dist_port: int):
    worker = vllm_worker(dist_port)
    assert worker.lorarl_join_mailbox("127.0.0.1", port, consumers=1, timeout=60) == 1
    loaded = [worker.lorarl_load_from_mailbox() for _ in range(2)]
    return loaded, plain(dict(worker.model_runner.model.named_parameters()))


def colocated_engine(port: int, rank: int):
    """The colocated engine's shared-bucket path (tensor-parallel workers in processes of their own), its worker here
    in a thread: a version loads; an input that fails part-way leaves the engine refusing to generate."""
    from lorarl.trainer.engines import EngineError
    from lorarl.trainer.engines.vllm_colocated import ColocatedVllmEngine

    model = tiny_lora_qwen2()
    llm = LocalLLM([vllm_worker(port)])
    engine = ColocatedVllmEngine(llm, workers=1, in_process=False, adapter_mode=False, bucket_bytes=16 << 10,
                                 timeout=60, device="cpu")  # fmt: skip
    stats = engine.sync_weights(iter_merged_weights(model), version=3, manifest=merged_weight_specs(model))
    state = plain(dict(llm.workers[0].model_runner.model.named_parameters()))

    def failing():
        yield from list(iter_merged_weights(model))[:4]
        raise RuntimeError("the merge failed")

    errors = []
    for call in (lambda: engine.sync_weights(failing(), version=4, manifest=merged_weight_specs(model)),
                 lambda: engine.generate([[1, 2]], n=1, temperature=1.0, top_p=1.0, max_tokens=2, seed=0)):  # fmt: skip
        try:
            call()
        except (RuntimeError, EngineError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    engine.close()
    return (
        (stats.version, stats.tensors, stats.bytes, stats.buckets),
        engine.version,
        errors,
        state,
        plain(fused_reference(model.merge_and_unload().state_dict())),
    )


def adapter_trainer(port: int, rank: int):
    from peft import get_peft_model_state_dict

    model = tiny_lora_qwen2()
    tensors = get_peft_model_state_dict(model)
    config = model.peft_config["default"].to_dict()  # sets and enums included: the sender writes them as JSON
    group = create_sync_group("127.0.0.1", port, 2, 0, timeout=60)
    BucketSender(group).send_adapter(tensors, config, version=2)
    return plain(tensors)


def adapter_engine(port: int, rank: int, dist_port: int, directory: str):
    worker = vllm_worker(dist_port)
    worker.lorarl_join_sync_group("127.0.0.1", port, 2, rank_offset=1, backend="gloo", timeout=60)
    return worker.lorarl_receive_adapter(directory)


class LocalLLM:
    """Stands in for `vllm.LLM` where no engine can start: `collective_rpc` calls the method on each worker, each in a
    thread of its own (vLLM runs them in worker processes), and returns their results in order."""

    def __init__(self, workers):
        self.workers = workers
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(workers))

    def collective_rpc(self, method, args=()):
        calls = [self.pool.submit(getattr(worker, method), *args) for worker in self.workers]
        return [call.result(timeout=120) for call in calls]

    def reset_prefix_cache(self):
        """No KV cache here to reset."""


def driver(port: int, rank: int, dist_port: int):
    """VllmWeightSync, the trainer-side driver, against the extension in one process: joins, sends two versions."""
    llm = LocalLLM([vllm_worker(dist_port)])
    sync = VllmWeightSync(llm, backend="gloo", port=port, timeout=60)
    model = tiny_lora_qwen2()
    versions = []
    for version in (1, 2):
        stats = sync.send(iter_merged_weights(model), version=version, manifest=merged_weight_specs(model))
        versions.append(stats.version)
    state = plain(dict(llm.workers[0].model_runner.model.named_parameters()))
    return versions, state, plain(fused_reference(model.merge_and_unload().state_dict()))

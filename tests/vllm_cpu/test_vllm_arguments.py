"""What lorarl hands vLLM is what vLLM takes: the engine arguments (GPU and CPU) are vLLM's own `EngineArgs`, with
lorarl's weight-transfer backend registered by its plugin; the sampling arguments are `SamplingParams`; vLLM's
`CompletionOutput`s become completions with the sampled tokens' log-probs and the weight version vLLM recorded."""

import types

import numpy as np
import pytest
import torch
import vllm

from lorarl.trainer import default_task
from lorarl.trainer.engines import SamplingParams
from lorarl.trainer.engines.base import EngineError
from lorarl.trainer.engines.vllm_worker import VllmSettings, engine_args, sampling_args, to_completions


def settings(**extra):
    values = {"dtype": torch.bfloat16, "tensor_parallel_size": 2, "gpu_memory_utilization": 0.4, "max_model_len": 2048,
              "seed": 3, "max_lora_rank": None, "devices": "1,2"}  # fmt: skip
    values.update(extra)
    return VllmSettings(str(default_task.MODEL_DIR), **values)  # a real local model directory


def test_engine_args_are_vllm_engine_args_with_the_real_weights_and_lorarls_transfer():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.engine.arg_utils import EngineArgs

    engine = EngineArgs(**engine_args(settings()))  # every key is one vLLM knows
    assert engine.load_format == "auto"  # the weights at model.path, not dummy ones
    assert (engine.tensor_parallel_size, engine.dtype, engine.max_model_len) == (2, "bfloat16", 2048)
    assert engine.weight_transfer_config.backend == "lorarl"
    assert "lorarl" in WeightTransferEngineFactory._registry  # registered by the plugin, in every vLLM process
    assert engine.logprobs_mode == "processed_logprobs"  # the distribution it samples from, after temperature
    assert (engine.gpu_memory_utilization, engine.enforce_eager, engine.enable_lora) == (0.4, False, False)
    with_adapter = EngineArgs(**engine_args(settings(max_lora_rank=32)))
    assert (with_adapter.enable_lora, with_adapter.max_lora_rank) == (True, 32)


def test_on_the_cpu_the_engine_is_eager_with_a_kv_cache_of_the_size_asked():
    from vllm.engine.arg_utils import EngineArgs

    cpu = EngineArgs(**engine_args(settings(device="cpu", tensor_parallel_size=1, kv_cache_gb=0.5)))
    assert cpu.enforce_eager  # compiling takes minutes on a CPU
    assert cpu.kv_cache_memory_bytes == 1 << 29
    assert cpu.distributed_executor_backend == "uni"  # its worker in the engine's process
    compiled = EngineArgs(**engine_args(settings(device="cpu", tensor_parallel_size=1, enforce_eager=False)))
    assert not compiled.enforce_eager


def test_the_settings_say_how_to_sync():
    assert (settings().sync_backend, settings().sync_ranks) == ("nccl", 2)  # one sync rank per TP worker
    assert settings(device="cpu").sync_backend == "gloo"


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 0.9), (0.7, 1.0), (0.0, 0.5)])
def test_sampling_args_are_vllm_sampling_params(temperature, top_p):
    n = 1 if temperature == 0 else 4
    args = sampling_args(SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=64, seed=11))
    params = vllm.SamplingParams(**args)
    assert (params.n, params.max_tokens, params.seed, params.logprobs) == (n, 64, 11, 0)
    assert not params.detokenize  # token ids are what the trainer uses
    if temperature == 0:
        assert (params.temperature, params.top_p) == (0.0, 1.0)  # greedy
    else:
        assert (params.temperature, params.top_p) == (temperature, top_p)


def test_greedy_sampling_of_several_responses_is_refused():
    with pytest.raises(ValueError, match="n=4"):
        SamplingParams(n=4, temperature=0.0, top_p=1.0, max_tokens=8, seed=0)


def test_completions_from_vllm_outputs_carry_the_version_vllm_recorded():
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, WeightVersionSpan

    def sample(index, tokens, logprobs, reason, versions):
        steps = [{t: Logprob(lp), 99: Logprob(-9.0)} for t, lp in zip(tokens, logprobs, strict=True)]
        spans = [WeightVersionSpan(v, start, end) for v, start, end in versions]
        return CompletionOutput(index, "", tokens, sum(logprobs), steps, finish_reason=reason, weight_versions=spans)

    outputs = [
        types.SimpleNamespace(outputs=[sample(0, [5, 6, 2], [-0.1, -0.2, -0.3], "stop", [("4", 0, 3)]),
                                       sample(1, [7, 8], [-1.0, -2.0], "length", [("4", 0, 2)])]),
        types.SimpleNamespace(outputs=[sample(0, [9], [-0.5], "stop", [("default", 0, 1)])]),
    ]  # fmt: skip
    got = to_completions(outputs, version=9)
    assert [(c.prompt_index, c.token_ids, c.logprobs, c.finished, c.version) for c in got] == [
        (0, (5, 6, 2), (-0.1, -0.2, -0.3), True, 4),
        (0, (7, 8), (-1.0, -2.0), False, 4),
        (1, (9,), (-0.5,), True, 0),  # "default": the weights from disk
    ]
    mixed = [types.SimpleNamespace(outputs=[sample(0, [5, 6], [-0.1, -0.2], "stop", [("4", 0, 1), ("5", 1, 2)])])]
    with pytest.raises(EngineError, match="several weight versions"):
        to_completions(mixed, version=5)
    missing = [types.SimpleNamespace(outputs=[CompletionOutput(0, "", [5], None, None, finish_reason="stop")])]
    with pytest.raises(ValueError, match="no per-token log-probs"):
        to_completions(missing, version=0)


def test_routes_are_asked_of_vllm_and_read_from_its_outputs():
    """`rollout.record_routes`: vLLM's `enable_return_routed_experts`; each `CompletionOutput`'s `routed_experts`
    (`[prompt + response - 1, layers, k]`, uint8 up to 256 experts) becomes the completion's int16 route."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    assert EngineArgs(**engine_args(settings(record_routes=True))).enable_return_routed_experts
    assert not EngineArgs(**engine_args(settings())).enable_return_routed_experts
    routes = np.arange(4 * 3 * 2, dtype=np.uint8).reshape(4, 3, 2)  # a prompt of 3, a response of 2
    output = CompletionOutput(0, "", [5, 1], -0.3, [{5: Logprob(-0.1)}, {1: Logprob(-0.2)}], finish_reason="stop",
                              routed_experts=routes)  # fmt: skip
    (completion,) = to_completions([types.SimpleNamespace(outputs=[output])], version=0)
    assert completion.routes.dtype == np.int16
    assert np.array_equal(completion.routes, routes)


def test_on_the_cpu_the_kv_cache_holds_a_steps_rollouts_and_no_more():
    from lorarl.trainer.engines import VllmEngineSettings
    from lorarl.trainer.engines.vllm_worker import VllmWorker, kv_cache_for

    # the embedded default: 3 layers, 2 KV heads of 32, float32, contexts of at most 32 positions
    tokens, gib = kv_cache_for(str(default_task.MODEL_DIR), torch.float32, sequences=256, tokens=520)
    assert tokens == 32  # the model's own limit
    per_token = 2 * 3 * 2 * 32 * 4  # keys and values, per layer, per KV head
    assert gib * (1 << 30) == 1.25 * 256 * 32 * per_token + (64 << 20)
    own = VllmEngineSettings()  # rollout.vllm.*, as the config defaults them
    context = types.SimpleNamespace(model_path=str(default_task.MODEL_DIR), dtype=torch.float32, seed=0,
                                    forms=("weights",), lora_rank=0, device="cpu", sequences=256,
                                    sequence_tokens=520, inline=True, bucket_bytes=1 << 20,
                                    record_routes=False)  # fmt: skip
    settings = VllmWorker.settings(own, context)
    assert (settings.max_model_len, settings.kv_cache_gb) == (32, gib)
    chosen = VllmWorker.settings(VllmEngineSettings(kv_cache_gb=3.0), context)
    assert (chosen.max_model_len, chosen.kv_cache_gb) == (None, 3.0)  # as the user set it

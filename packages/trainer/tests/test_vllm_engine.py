"""`rollout.engine=vllm` without a GPU: what can be checked is. The engine and sampling arguments are accepted by
vLLM's own `EngineArgs` and `SamplingParams`; vLLM's `CompletionOutput`s (with `Logprob`s) become completions with the
sampled tokens' log-probs; importing the module does not import vLLM. Generation itself needs a GPU (see README)."""

import subprocess
import sys
import types

import pytest
import torch

from lorarl.trainer import default_task
from lorarl.trainer.engines.vllm_worker import VllmSettings, engine_args, sampling_args, to_completions

vllm = pytest.importorskip("vllm")


def settings(**extra):
    values = {"dtype": torch.bfloat16, "tensor_parallel_size": 2, "gpu_memory_utilization": 0.4, "max_model_len": 2048,
              "seed": 3, "adapter_rank": None, "devices": "1,2"}  # fmt: skip
    values.update(extra)
    return VllmSettings(str(default_task.MODEL_DIR), **values)  # a real local model directory


def test_engine_args_are_vllm_engine_args_with_the_real_weights():
    from vllm.engine.arg_utils import EngineArgs

    args = engine_args(settings())
    engine = EngineArgs(**args)  # every key is one vLLM knows
    assert engine.load_format == "auto"  # the weights at model.path, not dummy ones
    assert (engine.tensor_parallel_size, engine.dtype, engine.max_model_len) == (2, "bfloat16", 2048)
    assert engine.worker_extension_cls == "lorarl.weight_sync.vllm.WeightSyncWorkerExtension"
    assert engine.logprobs_mode == "processed_logprobs"  # the distribution it samples from, after temperature
    assert not engine.enable_lora
    with_adapter = EngineArgs(**engine_args(settings(adapter_rank=32)))
    assert (with_adapter.enable_lora, with_adapter.max_lora_rank) == (True, 32)


def test_the_settings_say_how_to_sync():
    s = settings()
    assert (s.sync_backend, s.sync_ranks) == ("nccl", 2)  # one sync rank per TP worker


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 0.9), (0.7, 1.0), (0.0, 0.5)])
def test_sampling_args_are_vllm_sampling_params(temperature, top_p):
    n = 1 if temperature == 0 else 4
    args = sampling_args(n=n, temperature=temperature, top_p=top_p, max_tokens=64, seed=11)
    params = vllm.SamplingParams(**args)
    assert (params.n, params.max_tokens, params.seed, params.logprobs) == (n, 64, 11, 0)
    assert not params.detokenize  # token ids are what the trainer uses
    if temperature == 0:
        assert (params.temperature, params.top_p) == (0.0, 1.0)  # greedy
    else:
        assert (params.temperature, params.top_p) == (temperature, top_p)


def test_greedy_sampling_of_several_responses_is_refused():
    with pytest.raises(ValueError, match="n=4"):
        sampling_args(n=4, temperature=0.0, top_p=1.0, max_tokens=8, seed=0)


def test_completions_from_vllm_outputs():
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    def sample(index, tokens, logprobs, reason):
        steps = [{t: Logprob(lp), 99: Logprob(-9.0)} for t, lp in zip(tokens, logprobs, strict=True)]
        return CompletionOutput(index, "", tokens, sum(logprobs), steps, finish_reason=reason)

    outputs = [
        types.SimpleNamespace(outputs=[sample(0, [5, 6, 2], [-0.1, -0.2, -0.3], "stop"),
                                       sample(1, [7, 8], [-1.0, -2.0], "length")]),
        types.SimpleNamespace(outputs=[sample(0, [9], [-0.5], "stop")]),
    ]  # fmt: skip
    got = to_completions(outputs, version=4)
    assert [(c.prompt_index, c.token_ids, c.logprobs, c.finished, c.version) for c in got] == [
        (0, (5, 6, 2), (-0.1, -0.2, -0.3), True, 4),
        (0, (7, 8), (-1.0, -2.0), False, 4),
        (1, (9,), (-0.5,), True, 4),
    ]
    missing = [types.SimpleNamespace(outputs=[CompletionOutput(0, "", [5], None, None, finish_reason="stop")])]
    with pytest.raises(ValueError, match="no per-token log-probs"):
        to_completions(missing, version=0)


def test_importing_the_engine_module_does_not_import_vllm():
    modules = "lorarl.trainer.engines.vllm_worker, lorarl.trainer.engines.vllm_colocated, lorarl.trainer.loop"
    code = f"import sys, {modules}; print('vllm' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"

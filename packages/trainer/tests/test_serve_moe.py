"""`trainer serve --base` a mixture of experts, through the real `tinker` SDK: each run's adapter covers the fused
experts (`train_mlp`), two runs train and sample side by side on the one base, and each sequence scores under its own
run's adapter, as peft computes it in float64 from the adapter the server saved. (peft cannot mix adapters on fused
experts in one forward: such requests decode adapter by adapter.)"""

import pytest
import torch
from serve_fixtures import (
    KEYS,
    adapter_dir,
    datum,
    float64_policy,
    reference_logprobs,
    running_server,
    service_client,
)
from tinker import types
from trainer_fixtures import make_moe_model_dir


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-moe")
    model = str(make_moe_model_dir(root / "model"))
    with running_server(model, root / "state") as url:
        yield {"url": url, "model": model, "state": root / "state"}


def test_two_runs_on_one_moe_base_train_and_sample_under_their_own_experts(served):
    runs = []
    for i, key in enumerate(KEYS):
        tc = service_client(served["url"], key).create_lora_training_client(base_model=served["model"], rank=4,
                                                                              seed=20 + i).result()  # fmt: skip
        tc.forward_backward([datum([3, 4, 5, 6, 7, 8][i:])], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
        runs.append((tc, tc.save_weights_and_get_sampling_client().result()))
    prompt = types.ModelInput.from_ints([3, 4, 5])
    sampling = types.SamplingParams(max_tokens=5, temperature=1.0)
    futures = [(tc, sampler.sample(prompt, 1, sampling)) for _ in range(4) for tc, sampler in runs]
    for tc, future in futures:  # arriving together, whatever adapter each samples
        (sequence,) = future.result().sequences
        forward = tc.forward([datum([3, 4, 5, *sequence.tokens])], "cross_entropy").result()
        trainer = forward.loss_fn_outputs[0]["logprobs"].to_torch()[-len(sequence.tokens) :]
        torch.testing.assert_close(torch.tensor(sequence.logprobs), trainer, atol=2e-5, rtol=1e-5)
    for tc, _ in runs:  # the run's adapter, experts included, as peft loads it: what the server computed
        saved = adapter_dir(served["state"], tc.save_state("end").result().path)
        reference = float64_policy(served["model"], saved)
        assert any(type(m).__name__ == "ParamWrapper" for m in reference.modules())
        tokens = [3, 4, 5, 6, 7]
        forward = tc.forward([datum(tokens)], "cross_entropy").result()
        expected = reference_logprobs(reference, tokens[:-1], tokens[1:]).detach()
        torch.testing.assert_close(forward.loss_fn_outputs[0]["logprobs"].to_torch().double(), expected,
                                   atol=1e-5, rtol=1e-5)  # fmt: skip

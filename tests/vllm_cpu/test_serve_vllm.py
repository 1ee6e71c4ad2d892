"""`trainer serve --sampler vllm` against the real vLLM CPU engine, driven by the real `tinker` SDK: every run's
sampler weights served by one engine — merged into its weights snapshot by snapshot (`--vllm-adapters merged`, the
CPU's default) or as LoRA requests in one batch (`batched`) — each sequence scored under its own run's weights as the
server's trainer scores it. (The tiny model is a tied Qwen2, whose unembedding vLLM neither adapts nor loads apart
from the embeddings: its runs train attention and MLP; SmolLM2's runs take the SDK's default in
`benchmarks/tenants.py --samplers vllm`.)"""

import concurrent.futures

import pytest
import tinker
import torch
from serve_fixtures import KEYS, datum, running_server, service_client
from tinker import types
from vllm_cpu_helpers import make_model_dir

ATOL = 1e-4  # vLLM's CPU kernels against the trainer's forward, both float32


@pytest.fixture(scope="module", params=["merged", "batched"])
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"serve-vllm-{request.param}")
    model = str(make_model_dir(root / "model", tie=True))
    with running_server(model, root / "state", "--sampler", "vllm", "--vllm-adapters", request.param,
                        "--kv-cache-gb", "0.25", "--max-lora-rank", "16") as url:  # fmt: skip
        yield {"url": url, "model": model, "log": root / f"serve-{url.rsplit(':', 1)[1]}.log", "mode": request.param}


def new_run(served: dict, key: str = KEYS[0], rank: int = 4, seed: int = 0, unembed: bool = False):
    return (
        service_client(served["url"], key)
        .create_lora_training_client(base_model=served["model"], rank=rank, seed=seed, train_unembed=unembed)
        .result()
    )


def trained_run(served: dict, key: str, rank: int, seed: int):
    """A run of `rank` after one cross-entropy step (its adapter away from the base), and its sampling client."""
    tc = new_run(served, key, rank, seed)
    tc.forward_backward([datum([5 + seed, 6, 7, 8, 9, 10])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
    return tc, tc.save_weights_and_get_sampling_client().result()


def trainer_logprobs(tc, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    forward = tc.forward([datum(prompt + tokens)], "cross_entropy").result()
    return forward.loss_fn_outputs[0]["logprobs"].to_torch()[-len(tokens) :]


def test_two_runs_and_the_base_sample_from_one_engine_each_under_its_own_weights(served):
    runs = [trained_run(served, KEYS[i], rank=4 + 4 * i, seed=i) for i in range(2)]
    base = service_client(served["url"]).create_sampling_client(base_model=served["model"]).result()
    base_run = new_run(served)
    prompt = [1, 2, 3]
    sampling = types.SamplingParams(max_tokens=6, temperature=1.0)
    clients = [*runs, (base_run, base)]  # a fresh run's adapter is zero: the base's log-probs
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # requests arriving together: one vLLM batch
        futures = [(tc, pool.submit(lambda s=sampler: s.sample(types.ModelInput.from_ints(prompt), 2,
                                                                sampling).result()))
                   for _ in range(3) for tc, sampler in clients]  # fmt: skip
        answers = [(tc, future.result()) for tc, future in futures]
    moved = 0.0  # how far a run's log-probs lie from the base's: the runs' own weights served, not the base's
    for tc, response in answers:
        assert len(response.sequences) == 2
        for sequence in response.sequences:
            trainer = trainer_logprobs(tc, prompt, list(sequence.tokens))
            torch.testing.assert_close(torch.tensor(sequence.logprobs), trainer, atol=ATOL, rtol=0)
            base_logprobs = trainer_logprobs(base_run, prompt, list(sequence.tokens))
            moved = max(moved, float((trainer - base_logprobs).abs().max()))
    assert moved > 0.05
    rounds = [line for line in served["log"].read_text().splitlines() if "sampling" in line and "together" in line]
    assert any(int(line.split("of ")[1].split()[0]) > 1 for line in rounds), rounds  # several sessions in one round


def test_prompt_logprobs_and_stop_tokens_through_vllm(served):
    tc, sampler = trained_run(served, KEYS[0], rank=8, seed=3)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert scored[0] is None
    torch.testing.assert_close(torch.tensor(scored[1:]), trainer_logprobs(tc, prompt[:1], prompt[1:]), atol=ATOL,
                               rtol=0)  # fmt: skip
    stops = list(range(10, 60))  # most tokens end a response
    response = sampler.sample(types.ModelInput.from_ints(prompt), 4,
                              types.SamplingParams(max_tokens=8, stop=stops, seed=1)).result()  # fmt: skip
    for sequence in response.sequences:
        if sequence.stop_reason == "stop":
            assert sequence.tokens[-1] in stops or sequence.tokens[-1] == 1  # kept in the tokens (or end-of-text)
            assert not set(sequence.tokens[:-1]) & set(stops)
        else:
            assert len(sequence.tokens) == 8
    assert any(s.stop_reason == "stop" for s in response.sequences)
    again = sampler.sample(types.ModelInput.from_ints(prompt), 4,
                           types.SamplingParams(max_tokens=8, stop=stops, seed=1)).result()  # fmt: skip
    assert [s.tokens for s in again.sequences] == [s.tokens for s in response.sequences]  # seeded: the same


def test_weights_the_engine_cannot_serve_fail_their_own_request_and_it_serves_on(served):
    prompt, sampling = types.ModelInput.from_ints([1, 2]), types.SamplingParams(max_tokens=2)
    high, high_sampler = trained_run(served, KEYS[0], rank=32, seed=4)
    if served["mode"] == "batched":  # a LoRA request's rank is bounded by the engine's
        with pytest.raises(tinker.RequestFailedError, match="max-lora-rank 16"):
            high_sampler.sample(prompt, 1, sampling).result()
    else:  # merged weights know no rank
        (sequence,) = high_sampler.sample(prompt, 1, sampling).result().sequences
        trainer = trainer_logprobs(high, [1, 2], list(sequence.tokens))
        torch.testing.assert_close(torch.tensor(sequence.logprobs), trainer, atol=ATOL, rtol=0)
    unembedding = new_run(served, unembed=True).save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.RequestFailedError, match=r"vLLM cannot serve these sampler weights.*lm_head"):
        unembedding.sample(prompt, 1, sampling).result()
    with pytest.raises(tinker.RequestFailedError, match="stop: token ids must be in"):
        unembedding.sample(prompt, 1, types.SamplingParams(max_tokens=2, stop=[500])).result()
    _, fine = trained_run(served, KEYS[1], rank=4, seed=5)
    assert len(fine.sample(prompt, 3, sampling).result().sequences) == 3


def test_sampler_weights_saved_again_under_their_name_are_served_anew(served):
    tc, _ = trained_run(served, KEYS[0], rank=4, seed=6)
    path = tc.save_weights_for_sampler("again").result().path
    client, prompt = service_client(served["url"]), [1, 2, 3]
    sampling = types.SamplingParams(max_tokens=4)
    client.create_sampling_client(model_path=path).result().sample(types.ModelInput.from_ints(prompt), 1,
                                                                   sampling).result()  # fmt: skip
    tc.forward_backward([datum([9, 8, 7, 6, 5])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.2)).result()
    assert tc.save_weights_for_sampler("again").result().path == path
    again = client.create_sampling_client(model_path=path).result()
    (sequence,) = again.sample(types.ModelInput.from_ints(prompt), 1, sampling).result().sequences
    trainer = trainer_logprobs(tc, prompt, list(sequence.tokens))
    torch.testing.assert_close(torch.tensor(sequence.logprobs), trainer, atol=ATOL, rtol=0)

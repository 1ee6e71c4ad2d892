"""`trainer serve` driven by the real `tinker` SDK: each loss and Adam step against a float64 reference computed by peft
on the adapter the server saved, sampling log-probs against the trainer's, tenants interleaved against alone, a
restart resuming exactly, and the bad-input and isolation cases."""

import concurrent.futures
import importlib.util
import math
import subprocess
import sys
import time

import httpx
import pytest
import tinker
import torch
from serve_fixtures import (
    KEYS,
    adapter_dir,
    datum,
    float64_policy,
    reference_logprobs,
    running_server,
    saved_adapter,
    service_client,
)
from tinker import types
from trainer_fixtures import make_model_dir

SEQUENCES = [[1, 2, 3, 4, 5, 6], [3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 2]]
CLIP = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model = str(make_model_dir(root / "model"))
    with running_server(model, root / "state") as url:
        yield {"url": url, "model": model, "state": root / "state"}


def rl_data(seed: int) -> tuple[list, list[dict]]:
    """Data for the policy-gradient losses: sampler log-probs near the policy's and signed advantages."""
    g = torch.Generator().manual_seed(seed)
    data, inputs = [], []
    for tokens in SEQUENCES:
        n = len(tokens) - 1
        values = {"logprobs": (-2.5 + 0.3 * torch.randn(n, generator=g)).tolist(),
                  "advantages": torch.randn(n, generator=g).tolist()}  # fmt: skip
        data.append(datum(tokens, **values))
        inputs.append(values)
    return data, inputs


def reference_loss(loss_fn: str, logp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    """The per-token loss by its published formula (Tinker's loss docs), in float64, one datum."""
    if loss_fn == "cross_entropy":
        return -torch.tensor(inputs["weights"], dtype=torch.float64) * logp
    q = torch.tensor(inputs["logprobs"], dtype=torch.float64)
    a = torch.tensor(inputs["advantages"], dtype=torch.float64)
    ratio = torch.exp(logp - q)
    if loss_fn == "importance_sampling":
        return -ratio * a
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    clipped = ratio.clamp(low, high)
    if loss_fn == "ppo":
        return -torch.minimum(ratio * a, clipped * a)
    return -clipped.detach() * logp * a  # cispo


def trained_start(client, model: str, data) -> str:
    """Two cross-entropy steps (so the adapter's B factors are not zero), saved: the state every loss starts from."""
    tc = client.create_lora_training_client(base_model=model, rank=4, seed=3).result()
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    return tc.save_state("start").result().path


@pytest.mark.parametrize(("loss_fn", "config"), [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", CLIP),
                                                 ("cispo", CLIP), ("ppo", {})])  # fmt: skip
def test_loss_and_adam_step_equal_a_float64_reference(served, loss_fn, config):
    client = service_client(served["url"])
    weights = [[1.0] * (len(t) - 1) for t in SEQUENCES]
    weights[2][:3] = [0.0, 0.5, 2.0]
    ce_data = [datum(t, weights=w) for t, w in zip(SEQUENCES, weights, strict=True)]
    start = trained_start(client, served["model"], ce_data)
    if loss_fn == "cross_entropy":
        data, inputs = ce_data, [{"weights": w} for w in weights]
    else:
        data, inputs = rl_data(seed=len(loss_fn))
    tc = client.create_training_client_from_state(start).result()  # a fresh optimizer
    result = tc.forward_backward(data, loss_fn, config or None).result()
    adam = types.AdamParams(learning_rate=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.5)
    tc.optim_step(adam).result()
    after = saved_adapter(served["state"], tc.save_state("after").result().path)

    reference = float64_policy(served["model"], adapter_dir(served["state"], start))
    params = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    total = 0
    for i, (tokens, values) in enumerate(zip(SEQUENCES, inputs, strict=True)):
        logp = reference_logprobs(reference, tokens[:-1], tokens[1:])
        loss = reference_loss(loss_fn, logp, values, config)
        got = result.loss_fn_outputs[i]
        torch.testing.assert_close(got["logprobs"].to_torch().double(), logp.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["elementwise_loss"].to_torch().double(), loss.detach(), atol=1e-5, rtol=1e-5)
        total = total + loss.sum()
    assert result.metrics["loss:sum"] == pytest.approx(float(total.detach()), rel=1e-5, abs=1e-5)
    total.backward()

    grads = {n: p.grad for n, p in params.items()}
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    scale = min(1.0, adam.grad_clip_norm / (norm + 1e-6))
    assert scale < 1.0  # the clip is exercised
    for name, p in params.items():
        g = grads[name] * scale  # AdamW's first step: m̂ = g, v̂ = g², decoupled weight decay
        expected = p.detach() * (1 - adam.learning_rate * adam.weight_decay) - adam.learning_rate * g / (
            g.abs() + adam.eps
        )
        key = name.replace(".default.", ".")
        significant = g.abs() > 1e-4  # where |g| is near eps the step's size depends on float32 rounding
        torch.testing.assert_close(after[key].double()[significant], expected[significant], atol=1e-6, rtol=1e-5)
        assert (after[key].double() - expected).abs().max() <= 2 * adam.learning_rate


def test_sampled_logprobs_equal_the_trainers(served):
    client = service_client(served["url"])
    tc = client.create_lora_training_client(base_model=served["model"], rank=4, seed=1).result()
    tc.forward_backward([datum(SEQUENCES[0])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [1, 2, 3]
    sampling = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    response = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=sampling).result()
    assert len(response.sequences) == 4
    data = [datum(prompt + list(s.tokens)) for s in response.sequences]
    forward = tc.forward(data, "cross_entropy").result()
    for sequence, output in zip(response.sequences, forward.loss_fn_outputs, strict=True):
        n = len(sequence.tokens)
        trainer = output["logprobs"].to_torch()[-n:]
        torch.testing.assert_close(torch.tensor(sequence.logprobs), trainer, atol=2e-5, rtol=1e-5)
        assert sequence.stop_reason in ("stop", "length")
        assert (sequence.stop_reason == "length") == (n == 6 and 0 not in sequence.tokens)


def train_tenant(served: dict, key: str, seed: int, steps: int) -> dict[str, torch.Tensor]:
    """`steps` RL steps of one tenant (sampling from its new weights after each); its adapter at the end."""
    client = service_client(served["url"], key)
    tc = client.create_lora_training_client(base_model=served["model"], rank=4 + 4 * seed, seed=seed).result()
    data, _ = rl_data(seed)
    for _ in range(steps):
        tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        sampler.sample(types.ModelInput.from_ints([1, 2]), 2, types.SamplingParams(max_tokens=3)).result()
    return saved_adapter(served["state"], tc.save_state("end").result().path)


def test_two_tenants_interleaved_each_get_what_they_get_alone(served):
    alone = [train_tenant(served, KEYS[i], seed=i, steps=3) for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda i: train_tenant(served, KEYS[i], seed=i, steps=3), range(2)))
    for a, t in zip(alone, together, strict=True):
        assert a.keys() == t.keys()
        for key in a:
            torch.testing.assert_close(t[key], a[key], atol=0, rtol=0)
    assert alone[0].keys() == alone[1].keys()
    assert any(a.shape != b.shape for a, b in zip(alone[0].values(), alone[1].values(), strict=True))  # ranks 4, 8


def test_save_restart_load_resumes_exactly(tmp_path):
    model = str(make_model_dir(tmp_path / "model"))
    state = tmp_path / "state"
    data, _ = rl_data(seed=5)
    adam = types.AdamParams(learning_rate=0.02)

    def steps(tc, n, label):
        for _ in range(n):
            tc.forward_backward(data, "ppo").result()
            tc.optim_step(adam).result()
        return saved_adapter(state, tc.save_state(label).result().path)

    with running_server(model, state) as url:
        tc = service_client(url).create_lora_training_client(base_model=model, rank=4, seed=2).result()
        path = tc.save_state("start").result().path
        steps(tc, 2, "mid")
        path = path.replace("/start", "/mid")
        uninterrupted = steps(tc, 2, "end")
    with running_server(model, state) as url:
        client = service_client(url)
        saved = tinker.RestClient(base_url=url, api_key=KEYS[0]).list_checkpoints(tc.model_id).result().checkpoints
        assert sorted(c.tinker_path.rsplit("/", 1)[1] for c in saved) == ["end", "mid", "start"]
        resumed = steps(client.create_training_client_from_state_with_optimizer(path).result(), 2, "end")
        fresh_optimizer = steps(client.create_training_client_from_state(path).result(), 2, "end")
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], atol=0, rtol=0)
    assert any(not torch.equal(fresh_optimizer[k], uninterrupted[k]) for k in uninterrupted)  # the Adam state mattered


def test_a_bad_request_fails_its_own_future_only(served):
    tc = service_client(served["url"]).create_lora_training_client(base_model=served["model"], rank=4).result()
    good = [datum(SEQUENCES[0])]
    with pytest.raises(tinker.RequestFailedError, match="loss_fn='dro'") as failed:
        tc.forward_backward(good, "dro").result()
    assert failed.value.category == types.RequestErrorCategory.User
    out_of_vocab = [datum([1, 2, 99])]
    with pytest.raises(tinker.RequestFailedError, match=r"target_tokens: token ids must be in \[0, 16\)"):
        tc.forward_backward(out_of_vocab, "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="needs advantages"):
        tc.forward_backward([datum(SEQUENCES[0], logprobs=[0.0] * 5)], "importance_sampling").result()
    with pytest.raises(tinker.RequestFailedError, match="clip_hgh_threshold not taken by ppo"):
        tc.forward_backward(rl_data(0)[0], "ppo", {"clip_hgh_threshold": 1.1}).result()
    assert tc.forward_backward(good, "cross_entropy").result().metrics["loss:sum"] > 0  # the run goes on
    tc.optim_step(types.AdamParams(learning_rate=0.01)).result()


def test_keys_and_tenants_are_isolated(served):
    url, model = served["url"], served["model"]
    with pytest.raises(tinker.AuthenticationError):
        service_client(url, "tml-not-a-tenant").create_lora_training_client(base_model=model, rank=4).result()
    owner = service_client(url, KEYS[0]).create_lora_training_client(base_model=model, rank=4).result()
    path = owner.save_state("private").result().path
    sampler_path = owner.save_weights_for_sampler("private").result().path
    other = service_client(url, KEYS[1])
    with pytest.raises(tinker.RequestFailedError, match="belongs to another API key"):
        other.create_training_client_from_state(path).result()
    with pytest.raises(tinker.PermissionDeniedError, match="belongs to another API key"):
        other.create_sampling_client(model_path=sampler_path).result()
    headers = {"x-api-key": KEYS[1]}
    step = {"model_id": owner.model_id, "seq_id": 99, "adam_params": {"learning_rate": 1.0}}
    answer = httpx.post(f"{url}/api/v1/optim_step", headers=headers, json=step, timeout=10)
    future = httpx.post(f"{url}/api/v1/retrieve_future", headers=headers, json=answer.json(), timeout=30).json()
    assert future == {"error": f"model_id={owner.model_id!r}: belongs to another API key", "category": "user"}


def test_malformed_bodies_get_the_sdk_error_shape(served):
    headers = {"x-api-key": KEYS[0]}
    url = served["url"]
    answer = httpx.post(f"{url}/api/v1/create_model", content=b"{not json", headers=headers, timeout=10)
    assert answer.status_code == 400
    assert answer.json() == {"error": "/api/v1/create_model: the body is not JSON", "category": "user"}
    answer = httpx.post(f"{url}/api/v1/forward_backward", content=b"\xff\x00junk", timeout=10,
                        headers={**headers, "content-type": "application/x-protobuf"})  # fmt: skip
    assert answer.status_code == 400
    assert answer.json()["category"] == "user"
    assert "not a ForwardBackwardRequest" in answer.json()["error"]
    answer = httpx.post(f"{url}/api/v1/asample", headers=headers, timeout=10,
                        json={"sampling_session_id": "nope", "prompt": {"chunks": []}})  # fmt: skip
    assert answer.status_code == 404
    assert answer.json() == {"error": "sampling_session_id='nope': no such sampling session", "category": "user"}


def test_concurrent_samples_of_two_tenants_each_score_under_their_own_adapter(served):
    """Requests arriving together are decoded in one batch whatever adapter each samples (peft's mixed batch): each
    sequence's log-probs are still those its own run's trainer computes."""
    runs = []
    for i, key in enumerate(KEYS):
        tc = service_client(served["url"], key).create_lora_training_client(base_model=served["model"], rank=4,
                                                                              seed=10 + i).result()  # fmt: skip
        tc.forward_backward([datum(SEQUENCES[i])], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
        runs.append((tc, tc.save_weights_and_get_sampling_client().result()))
    prompt = types.ModelInput.from_ints([1, 2, 3])
    sampling = types.SamplingParams(max_tokens=5, temperature=1.0)
    futures = [(tc, sampler.sample(prompt, 1, sampling)) for _ in range(6) for tc, sampler in runs]
    for tc, future in futures:
        (sequence,) = future.result().sequences
        forward = tc.forward([datum([1, 2, 3, *sequence.tokens])], "cross_entropy").result()
        trainer = forward.loss_fn_outputs[0]["logprobs"].to_torch()[-len(sequence.tokens) :]
        torch.testing.assert_close(torch.tensor(sequence.logprobs), trainer, atol=2e-5, rtol=1e-5)


def test_a_run_keeps_its_newest_sampler_weights_in_memory(tmp_path):
    """Each step's unnamed sampler weights would otherwise pile up in memory: past `--sampler-snapshots` the oldest
    are let go (a request for one says so), while named ones are read back from disk."""
    model = str(make_model_dir(tmp_path / "model"))
    with running_server(model, tmp_path / "state", "--sampler-snapshots", "2") as url:
        tc = service_client(url).create_lora_training_client(base_model=model, rank=4).result()
        named = tc.save_weights_for_sampler("kept").result().path
        samplers = [tc.save_weights_and_get_sampling_client().result() for _ in range(3)]
        prompt, sampling = types.ModelInput.from_ints([1, 2]), types.SamplingParams(max_tokens=2)
        with pytest.raises(tinker.RequestFailedError, match="were let go"):
            samplers[0].sample(prompt, 1, sampling).result()
        for sampler in samplers[1:]:
            assert len(sampler.sample(prompt, 1, sampling).result().sequences) == 1
        from_disk = service_client(url).create_sampling_client(model_path=named).result()
        assert len(from_disk.sample(prompt, 1, sampling).result().sequences) == 1


def test_results_are_let_go_after_their_time_to_live(tmp_path):
    """A long-lived server would otherwise hold every request's result: `--result-ttl` seconds after it is ready, a
    result is let go, and asking for it again says so."""
    model = str(make_model_dir(tmp_path / "model"))
    with running_server(model, tmp_path / "state", "--result-ttl", "1") as url:
        headers = {"x-api-key": KEYS[0]}

        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(f"{url}/api/v1/{path}", headers=headers, json=body, timeout=30)

        session = post("create_session", {})
        create = {"session_id": session.json()["session_id"], "base_model": model, "lora_config": {"rank": 4}}
        request = {"request_id": post("create_model", create).json()["request_id"]}
        assert post("retrieve_future", request).json()["type"] == "create_model"
        assert post("retrieve_future", request).json()["type"] == "create_model"  # polled again: still there
        time.sleep(2.5)
        gone = post("retrieve_future", request)
        assert gone.status_code == 404
        assert gone.json() == {"error": f"request_id={request['request_id']!r}: no such request (results are kept "
                               "1 s after they are ready: --result-ttl)", "category": "user"}  # fmt: skip


def test_a_server_that_cannot_start_says_why_without_a_traceback(tmp_path):
    cases = [(["--base", str(tmp_path / "missing")], "is not a Hugging Face model directory")]
    if importlib.util.find_spec("vllm") is None:  # this project's environment: vLLM lives in its own
        cases.append((["--sampler", "vllm", "--base", "default"], "--sampler vllm: vLLM is not installed here"))
    for args, expected in cases:
        command = [sys.executable, "-m", "lorarl.trainer.cli", "serve", "--state-dir", str(tmp_path / "state"), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert expected in done.stderr, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith("trainer serve: error: "), done.stderr
        assert "usage:" not in done.stderr, done.stderr  # one line, not the usage before it

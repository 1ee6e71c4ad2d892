"""`trainer serve`'s edges, with the real `tinker` SDK and its own wire format: a run's requests never run out of
their order however they arrive (and are answered at once), a gap that never fills fails the later request, bad
fields are the client's errors, a request from before a restart says so, and a finished (or silent) session lets go
of what it held."""

import time
from pathlib import Path

import httpx
import pytest
import tinker
from serve_fixtures import KEYS, SERVERS, datum, running_server, service_client
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from trainer_fixtures import make_model_dir

ORDER_WAIT_S = 3.0
HEADERS = {"x-api-key": KEYS[0]}
TOKENS = [1, 2, 3, 4, 5, 6]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("edges")
    model = str(make_model_dir(root / "model"))
    with running_server(model, root / "state", "--order-wait", str(ORDER_WAIT_S)) as url:
        yield {"url": url, "model": model}


def post(url: str, route: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/{route}", headers={**HEADERS, **kwargs.pop("headers", {})}, timeout=60, **kwargs)


def forward_backward_body(model_id: str, seq_id: int, data: list) -> bytes:
    """A `/forward_backward` body as the SDK writes it (its own protobuf conversion)."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"), model_id=model_id,
        seq_id=seq_id,
    )  # fmt: skip
    return forward_backward_request_to_proto(request).SerializeToString()


def result(url: str, answer: httpx.Response):
    """A request's result (or error), polled as the SDK polls `retrieve_future`."""
    assert answer.status_code == 200, answer.text
    while True:
        polled = post(url, "retrieve_future", json={"request_id": answer.json()["request_id"]})
        if polled.status_code != 408:
            return polled


def test_a_run_s_requests_run_in_its_order_whatever_order_they_arrive(served):
    """The optimizer step (seq_id 2) arrives before the forward_backward it follows (seq_id 1): it is answered at once
    and runs after it, as the same two sent in order do (the same gradient norm)."""
    url, model = served["url"], served["model"]
    reference = service_client(url).create_lora_training_client(base_model=model, rank=4, seed=3).result()
    reference.forward_backward([datum(TOKENS)], "cross_entropy").result()
    expected = reference.optim_step(types.AdamParams(learning_rate=0.1)).result().metrics["optim/grad_norm:mean"]
    tc = service_client(url).create_lora_training_client(base_model=model, rank=4, seed=3).result()
    started = time.monotonic()
    step = post(url, "optim_step", json={"model_id": tc.model_id, "seq_id": 2,
                                          "adam_params": {"learning_rate": 0.1}})  # fmt: skip
    assert time.monotonic() - started < ORDER_WAIT_S  # answered at once, not held for its turn
    fwd = post(url, "forward_backward", content=forward_backward_body(tc.model_id, 1, [datum(TOKENS)]),
               headers={"content-type": "application/x-protobuf"})  # fmt: skip
    result(url, fwd)
    metrics = result(url, step).json()["metrics"]
    assert expected > 0
    assert metrics["optim/grad_norm:mean"] == expected  # it stepped on the gradient sent before it


def test_a_gap_that_never_fills_fails_the_later_request(served):
    url = served["url"]
    tc = service_client(url).create_lora_training_client(base_model=served["model"], rank=4).result()
    step = post(url, "optim_step", json={"model_id": tc.model_id, "seq_id": 5,
                                          "adam_params": {"learning_rate": 0.1}})  # fmt: skip
    failed = result(url, step).json()
    assert failed["category"] == "user"
    assert failed["error"] == (f"seq_id 5 of {tc.model_id} waited {ORDER_WAIT_S:g} s for seq_id 1, which never came; "
                               "not run out of order")  # fmt: skip


def test_a_forward_backward_the_sdk_splits_into_chunks_runs_whole(served):
    """More data than the SDK's chunk (1024 data): it sends the first chunk last, and the server combines nothing out
    of order: the loss is the sum over every datum."""
    tc = service_client(served["url"]).create_lora_training_client(base_model=served["model"], rank=4).result()
    one = tc.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"]
    many = tc.forward([datum(TOKENS)] * 1025, "cross_entropy").result().metrics["loss:sum"]
    assert many == pytest.approx(1025 * one, rel=1e-5)


def test_bad_fields_are_the_client_s_errors(served):
    url, model = served["url"], served["model"]
    sc = service_client(url)
    session = post(url, "create_session", json={}).json()["session_id"]
    answer = post(url, "create_model", json={"session_id": session, "base_model": model,
                                             "lora_config": {"rank": "abc"}})  # fmt: skip
    assert answer.status_code == 400
    assert answer.json() == {"error": "lora_config.rank: expected an integer, got 'abc'", "category": "user"}
    sampler = sc.create_sampling_client(base_model=model).result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    with pytest.raises(tinker.BadRequestError, match=r"sampling_params.max_tokens must be >= 1"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=0)).result()
    sampling = post(url, "create_sampling_session", json={"session_id": session, "base_model": model,
                                                          "sampling_session_seq_id": 0}).json()  # fmt: skip
    chunks = [{"type": "encoded_text", "tokens": [1, 2]}]
    answer = post(url, "asample", json={"sampling_session_id": sampling["sampling_session_id"], "num_samples": "x",
                                        "prompt": {"chunks": chunks}})  # fmt: skip
    assert answer.status_code == 400
    assert answer.json() == {"error": "body.num_samples: expected an integer, got 'x'", "category": "user"}
    tc = sc.create_lora_training_client(base_model=model, rank=4).result()
    empty = types.Datum(model_input=types.ModelInput.from_ints([]), loss_fn_inputs={"target_tokens": []})
    with pytest.raises(tinker.RequestFailedError, match=r"data\[0\].model_input: empty") as failed:
        tc.forward_backward([empty], "cross_entropy").result()
    assert failed.value.category == types.RequestErrorCategory.User
    tc = sc.create_lora_training_client(base_model=model, rank=4).result()  # a run of its own: raw requests
    for seq_id, (value, got) in enumerate((("fast", "'fast'"), (True, "True")), 1):  # a string, a boolean
        answer = result(url, post(url, "optim_step", json={"model_id": tc.model_id, "seq_id": seq_id,
                                                           "adam_params": {"learning_rate": value}}))  # fmt: skip
        assert answer.json()["error"] == f"adam_params.learning_rate: expected a number, got {got}"
    answer = post(url, "get_info", json={"model_id": 7})
    assert answer.json()["error"] == "body.model_id: expected a string, got 7"


def adapter_model_dir(directory: Path) -> str:
    """A model whose runs each hold megabytes (adapter, gradients and AdamW state at rank 32): what a leak shows."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lorarl.trainer import default_task

    tokenizer = default_task.build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=16, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def short_run(url: str, model: str) -> str:
    """A client's whole life: a run, a step, a sampler snapshot, then the session closed. Its run's id."""
    sc = tinker.ServiceClient(base_url=url, api_key=KEYS[0])
    tc = sc.create_lora_training_client(base_model=model, rank=32).result()
    tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
    tc.save_weights_and_get_sampling_client().result().sample(types.ModelInput.from_ints([1, 2]), 1,
                                                     types.SamplingParams(max_tokens=2)).result()  # fmt: skip
    sc.close("success").result()
    return tc.model_id


@pytest.mark.starts_first
def test_finished_sessions_let_go_of_their_runs_and_memory_stays_flat(tmp_path):
    model = adapter_model_dir(tmp_path / "model")
    with running_server(model, tmp_path / "state", "--session-timeout", "12") as url:
        pid = SERVERS[url].pid
        for _ in range(10):  # warm: the allocator's arenas, the first adapters' pages
            short_run(url, model)
        before = rss_mb(pid)
        for _ in range(50):
            last = short_run(url, model)
        after = rss_mb(pid)
        assert after - before < 40, (before, after)  # 50 runs held would be ~400 MB
        gone = post(url, "get_info", json={"model_id": last})
        assert gone.status_code == 404
        assert "no such training run" in gone.json()["error"]
        # a client that vanished without closing: its session goes once silent for --session-timeout
        session = post(url, "create_session", json={}).json()["session_id"]
        created = post(url, "create_model", json={"session_id": session, "base_model": model, "model_seq_id": 0,
                                                  "lora_config": {"rank": 4}})  # fmt: skip
        result(url, created)
        model_id = created.json()["model_id"]
        assert post(url, "get_info", json={"model_id": model_id}).status_code == 200
        time.sleep(12 + 4)
        assert post(url, "get_info", json={"model_id": model_id}).status_code == 404
        assert post(url, "session_heartbeat", json={"session_id": session}).status_code == 410


def test_a_request_from_before_a_restart_says_so(tmp_path):
    model = str(make_model_dir(tmp_path / "model"))
    with running_server(model, tmp_path / "state") as url:
        tc = service_client(url).create_lora_training_client(base_model=model, rank=4).result()
        answer = post(url, "optim_step", json={"model_id": tc.model_id, "seq_id": 1,
                                               "adam_params": {"learning_rate": 0.1}})  # fmt: skip
        request_id = answer.json()["request_id"]
    with running_server(model, tmp_path / "state") as url:
        polled = post(url, "retrieve_future", json={"request_id": request_id})
        assert polled.status_code == 404
        assert polled.json()["error"].startswith(f"request_id={request_id!r}: made before this server restarted")

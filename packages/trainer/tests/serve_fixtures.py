"""A real `trainer serve` process on a free port, and float64 references of what it computes."""

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

KEYS = ("tml-tenant-a", "tml-tenant-b")
CLIENTS: dict[str, list] = {}  # server URL -> the SDK clients made for it (closed before the server stops)
SERVERS: dict[str, subprocess.Popen] = {}  # server URL -> its process, while it runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dies_with_parent() -> None:
    """In a child, before it runs: the kernel kills it when its parent dies (a test process killed by its timeout
    would otherwise leave a server computing on the machine's cores)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def running_server(model: str, state_dir: Path, *extra: str):
    """`trainer serve` with `model` as a base and the two tenants' keys; yields its base URL."""
    port = free_port()
    log = open(state_dir.parent / f"serve-{port}.log", "w")  # noqa: SIM115
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "lorarl.trainer.cli", "serve", "--port", str(port), "--base", model,
               "--state-dir", str(state_dir), *[a for key in KEYS for a in ("--api-key", key)], *extra]  # fmt: skip
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=dies_with_parent)
    url = f"http://127.0.0.1:{port}"
    SERVERS[url] = process
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.post(f"{url}/api/v1/client/config", json={}, headers={"x-api-key": KEYS[0]}, timeout=2)
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start: {Path(log.name).read_text()[-2000:]}") from None
                time.sleep(0.3)
        yield url
    finally:
        for client in CLIENTS.pop(url, []):  # their sessions end: no heartbeat left knocking at a stopped server
            with contextlib.suppress(Exception):
                client.close("success").result(timeout=10)
        process.terminate()
        process.wait(timeout=30)
        SERVERS.pop(url, None)
        log.close()


def service_client(url: str, key: str = KEYS[0]):
    import tinker

    client = tinker.ServiceClient(base_url=url, api_key=key)
    CLIENTS.setdefault(url, []).append(client)
    return client


def datum(tokens: list[int], **inputs):
    """A `tinker` datum predicting each next token of `tokens` (inputs: per-target float lists)."""
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})  # fmt: skip


def saved_adapter(state_dir: Path, tinker_path: str) -> dict[str, torch.Tensor]:
    """The adapter tensors a `tinker://.../weights|sampler_weights/<name>` path saved, read from its peft directory."""
    from safetensors.torch import load_file

    run, kind, name = tinker_path.removeprefix("tinker://").split("/")
    return load_file(state_dir / run.replace(":", "_") / kind / name / "adapter" / "adapter_model.safetensors")


def adapter_dir(state_dir: Path, tinker_path: str) -> Path:
    run, kind, name = tinker_path.removeprefix("tinker://").split("/")
    return state_dir / run.replace(":", "_") / kind / name / "adapter"


def float64_policy(model_dir: str, adapter: Path):
    """The base in float64 with a saved adapter loaded by peft itself: the reference the server is checked against."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # (a mixture's experts in transformers' own per-expert loop: its grouped GEMM takes no float64)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, experts_implementation="eager")
    return PeftModel.from_pretrained(base, str(adapter), is_trainable=True)


def reference_logprobs(model, tokens: list[int], targets: list[int]) -> torch.Tensor:
    """log p(targets[i] | tokens[:i+1]) for one sequence, from the full float64 logits."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(targets)[:, None])[:, 0]


def make_byte_model_dir(directory: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2 with a byte-level BPE tokenizer without merges (each byte a token, `<|endoftext|>` its
    end): any text encodes, so a client's renderer (the cookbook's role_colon) runs on it; AutoTokenizer loads it as
    the Qwen2 tokenizer it is, in any transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model: str, state_dir: Path, *extra: str):
    """`trainer serve` with `model` as a base and the two tenants' keys; yields its base URL."""
    port = free_port()
    log = open(state_dir.parent / f"serve-{port}.log", "w")  # noqa: SIM115
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "lorarl.trainer.cli", "serve", "--port", str(port), "--base", model,
               "--state-dir", str(state_dir), *[a for key in KEYS for a in ("--api-key", key)], *extra]  # fmt: skip
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
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
        process.terminate()
        process.wait(timeout=30)
        log.close()


def service_client(url: str, key: str = KEYS[0]):
    import tinker

    return tinker.ServiceClient(base_url=url, api_key=key)


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

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    return PeftModel.from_pretrained(base, str(adapter), is_trainable=True)


def reference_logprobs(model, tokens: list[int], targets: list[int]) -> torch.Tensor:
    """log p(targets[i] | tokens[:i+1]) for one sequence, from the full float64 logits."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(targets)[:, None])[:, 0]

"""The vLLM warnings lorarl quiets are the harmless ones it causes on every run — a rotary embedding "failing" to load
at each reload of full weights, a float32 checkpoint loaded into a bf16/fp16 engine — and no others: records made as
vLLM's loggers make them (its `layerwise.py` and `models/utils.py`)."""

import logging

import torch

from lorarl.weight_sync.vllm import HarmlessLoadWarnings


def record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("vllm", logging.WARNING, "x.py", 1, msg, args, None)


def test_only_the_known_harmless_warnings_are_dropped():
    keep = HarmlessLoadWarnings().filter
    assert not keep(record("%s: Failed to load weights", "RotaryEmbedding"))
    assert not keep(record("%s: Failed to load weights", "Llama3RotaryEmbedding"))
    assert keep(record("%s: Failed to load weights", "QKVParallelLinear"))  # a real layer left unloaded: shown
    narrowing = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    assert not keep(record(narrowing, "layers.0.mlp.down_proj.weight", torch.float32, torch.bfloat16))
    assert not keep(record(narrowing, "norm.weight", torch.float32, torch.float16))
    assert keep(record(narrowing, "norm.weight", torch.float16, torch.bfloat16))  # not what a chosen dtype does
    assert keep(record(narrowing, "embed.weight", torch.int8, torch.bfloat16))
    assert keep(record("anything else %s", "at all"))

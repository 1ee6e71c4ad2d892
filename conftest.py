"""Shared test fixtures: tiny models built in code (no downloads), for every package's tests."""

import importlib.metadata
import importlib.util
import os

import pytest
from tiny_models import tiny_gpt2, tiny_qwen2

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the tests against the real vLLM engine run in vLLM's CPU environment (tests/test_vllm_cpu.py starts them there)
collect_ignore = [] if importlib.util.find_spec("vllm") else ["tests/vllm_cpu"]
# verifiers v1's tests run in its environment (tests/test_verifiers_v1.py starts them there)
if not importlib.util.find_spec("verifiers") or int(importlib.metadata.version("verifiers").split(".")[1]) < 4:
    collect_ignore.append("tests/verifiers_v1")


@pytest.fixture
def make_qwen2():
    return tiny_qwen2


@pytest.fixture
def make_gpt2():
    return tiny_gpt2

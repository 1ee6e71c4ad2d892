"""Shared test fixtures: tiny models built in code (no downloads), for every package's tests."""

import os

import pytest
from tiny_models import tiny_gpt2, tiny_qwen2

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def make_qwen2():
    return tiny_qwen2


@pytest.fixture
def make_gpt2():
    return tiny_gpt2

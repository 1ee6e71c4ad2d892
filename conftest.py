"""Shared test fixtures: tiny models built in code (no downloads), for every package's tests; and the order the suite
runs in, on a worker per core (pytest-xdist: `-n auto` in pyproject.toml; `-n 0` runs in one process)."""

import functools
import importlib.metadata
import importlib.util
import os

import pytest
from tiny_models import tiny_gpt2, tiny_moe, tiny_qwen2

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the tests against the real vLLM engine run in vLLM's CPU environment (tests/test_vllm_cpu.py starts them there)
collect_ignore = [] if importlib.util.find_spec("vllm") else ["tests/vllm_cpu"]
# verifiers v1's tests run in its environment (tests/test_verifiers_v1.py starts them there)
if not importlib.util.find_spec("verifiers") or int(importlib.metadata.version("verifiers").split(".")[1]) < 4:
    collect_ignore.append("tests/verifiers_v1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "starts_first: minutes long (a whole side suite or program): runs before the "
                                       "rest, which the other workers share out meanwhile")  # fmt: skip


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker per core this process may use, at most 4 (each holds torch, and many tests start processes
    of their own)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `starts_first` tests first (the workers take tests one at a time, in this order), the rest as collected:
    the longest ones never start last, when the other workers have nothing left to do."""
    items.sort(key=lambda item: item.get_closest_marker("starts_first") is None)


@pytest.fixture
def make_qwen2():
    return tiny_qwen2


@pytest.fixture
def make_gpt2():
    return tiny_gpt2


@pytest.fixture
def make_qwen3_moe():
    return functools.partial(tiny_moe, "qwen3_moe")


@pytest.fixture
def make_qwen2_moe():
    return functools.partial(tiny_moe, "qwen2_moe")

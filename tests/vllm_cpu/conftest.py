"""Tests against the real vLLM engine: they run in the vLLM CPU environment (`scripts/vllm_cpu_env.sh`), started by
`tests/test_vllm_cpu.py` from the project's own environment (which has no vLLM)."""

import os

import pytest
from trainer_fixtures import make_tiny_setup
from vllm_cpu_helpers import make_model_dir

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def trainer_setup(tmp_path_factory):
    """The trainer tests' prompts, reward and data, on a tied model vLLM's CPU attention takes (head size 32)."""
    root = tmp_path_factory.mktemp("setup")
    return make_tiny_setup(root) | {"model": str(make_model_dir(root / "vllm-model", tie=True))}

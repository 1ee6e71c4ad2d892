"""Tests against the real vLLM engine: they run in the vLLM CPU environment (`scripts/vllm_cpu_env.sh`), started by
`tests/test_vllm_cpu.py` from the project's own environment (which has no vLLM)."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

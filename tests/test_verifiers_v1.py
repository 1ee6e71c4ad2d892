"""The tests of verifiers v1 environments (`tests/verifiers_v1/`), run in verifiers v1's environment as part of `uv
run pytest` (verifiers 0.4 pins mcp and openai beside which its classic releases, the project's `verifiers` extra, do
not install). The environment is made — or made again, when the script or a package's dependencies changed — by
`scripts/vllm_cpu_env.sh --verifiers-v1`; `LORARL_VERIFIERS_V1_ENV` names another place for it. Those tests never
skip."""

import os
from pathlib import Path

import pytest
from side_envs import ROOT, run_side_tests, vllm_environment

ENV = Path(os.environ.get("LORARL_VERIFIERS_V1_ENV", ROOT / ".venv-verifiers-v1"))
MIN_TESTS = 10  # what tests/verifiers_v1 holds today, at least


@pytest.mark.starts_first
@pytest.mark.timeout(3600)
def test_the_verifiers_v1_tests_pass_in_its_environment(tmp_path):
    python = vllm_environment(ENV, "--verifiers-v1")
    run_side_tests(python, "tests/verifiers_v1", MIN_TESTS, tmp_path / "report.xml", "verifiers v1")

"""`scripts/gpu_check.py` in its CPU mode, run as the README tells a GPU machine to run it (python, PYTHONPATH on
the packages' sources, no uv) in an environment stripped to what such a machine has (`bare_gpu_machine`) plus the
vendored pure-Python dependencies: every check passes or says why it skipped, and a failing check hides none of the
others."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [str(ROOT / "packages" / p / "src") for p in ("lora_merge", "padding", "weight_sync", "trainer")]
BARE = os.pathsep.join([*SOURCES, str(ROOT / "tests" / "bare_gpu_machine")])


def gpu_check(out: Path, *args: str, pythonpath: str = BARE) -> tuple[subprocess.CompletedProcess, dict]:
    env = os.environ | {"PYTHONPATH": pythonpath}
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)  # fmt: skip
    return done, json.loads((out / "gpu_check.json").read_text())


@pytest.fixture(scope="module")
def vendor(tmp_path_factory) -> Path:
    """The vendored dependencies, packed from this environment (as before a GPU session)."""
    directory = tmp_path_factory.mktemp("vendor")
    command = [sys.executable, "scripts/gpu_check.py", "--pack-vendor", "--vendor", str(directory)]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=60)
    return directory


def test_the_bare_machine_lacks_what_a_gpu_machine_lacks(vendor):
    probe = "import importlib.util as u; print([n for n in ('omegaconf', 'rich', 'matplotlib') if u.find_spec(n)])"
    for pythonpath, found in ((BARE, []), (os.pathsep.join([BARE, str(vendor)]), ["omegaconf", "rich"])):
        done = subprocess.run([sys.executable, "-c", probe], env=os.environ | {"PYTHONPATH": pythonpath},
                              capture_output=True, text=True, check=True)  # fmt: skip
        assert done.stdout.strip() == str(found)
    assert not list(vendor.rglob("*.so"))  # pure Python: it runs on any machine's python3


@pytest.mark.starts_first
def test_the_cpu_mode_runs_every_check(tmp_path, vendor):
    done, report = gpu_check(tmp_path, "--device", "cpu", "--smoke", "--vendor", str(vendor))
    assert done.returncode == 0, done.stdout + done.stderr
    checks = report["checks"]
    assert list(checks) == ["environment", "merge_kernels", "streaming", "ipc_mailbox", "hf_engine", "trainer_default",
                            "trainer_smollm2", "fsdp_one_rank", "merge_throughput", "step_vs_trl"]  # fmt: skip
    skipped = {name for name, check in checks.items() if check["status"] == "skipped"}
    assert skipped == {"merge_throughput", "step_vs_trl"}  # whole benchmarks: not in --smoke
    assert all(checks[name]["status"] == "ok" for name in set(checks) - skipped), checks
    assert report["environment"]["torch"] == torch.__version__
    figures = {name: check.get("figures", {}) for name, check in checks.items()}
    assert figures["merge_kernels"]["backends"] == ["torch", "cpp"]
    assert figures["merge_kernels"]["cases"] == 2 * 3 * 2  # backends x weight dtypes x factor dtypes
    assert figures["merge_kernels"]["worst_error"]["W bf16 (ulps)"]["lorarl"] <= 1
    assert figures["streaming"]["lora_layers"] == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert figures["hf_engine"]["adapter_matches_merged_prompts"] == 8
    assert figures["hf_engine"]["process_factors_sync_bytes"] < figures["hf_engine"]["inline_merged_sync_bytes"]
    assert figures["trainer_default"]["steps"] == 6
    assert figures["trainer_smollm2"]["steps"] == 3
    assert figures["fsdp_one_rank"]["process_group"] == "gloo"
    assert figures["fsdp_one_rank"]["sharded_parameters"] > 0
    summary = (tmp_path / "gpu_check.md").read_text()
    for name, check in checks.items():
        assert f"| {name} | {check['status']} |" in summary
    assert (tmp_path / "trainer-default" / "metrics.jsonl").is_file()
    assert "matplotlib is not installed" in (tmp_path / "trainer-default.log").read_text()  # runs without plots


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA, where CUDA checks fail")
def test_a_failing_check_hides_none_of_the_others(tmp_path):
    only = "streaming,environment,hf_engine"
    done, report = gpu_check(
        tmp_path, "--device", "cuda", "--smoke", "--only", only, pythonpath=os.pathsep.join(SOURCES)
    )
    assert done.returncode == 1
    checks = report["checks"]
    assert list(checks) == only.split(",")
    assert checks["environment"]["status"] == "ok"
    for name in ("streaming", "hf_engine"):
        assert checks[name]["status"] == "failed"
        assert "cuda" in checks[name]["error"].lower(), checks[name]["error"]
    assert "| streaming | failed |" in (tmp_path / "gpu_check.md").read_text()


def test_checks_that_no_longer_fit_the_budget_are_listed_not_run(tmp_path):
    done, report = gpu_check(
        tmp_path,
        "--device",
        "cpu",
        "--only",
        "environment,streaming",
        "--budget",
        "5",
        pythonpath=os.pathsep.join(SOURCES),
    )
    assert done.returncode == 0
    assert {c["status"] for c in report["checks"].values()} == {"not run"}
    assert "--budget of 5 s was spent" in report["checks"]["streaming"]["reason"]

"""The C++ kernel built for CPUs without AVX-512 (x86-64-v3: AVX2 + FMA), run here in a process of its own (one op
library per process), against the float64 reference: the vector code that machines without AVX-512 execute. On such
a machine that is its native build."""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from merge_reference import assert_merged_close

CASES = [  # (shape, rank, weight dtype, out dtype): edges, whole tiles, row remainders, a large output, fp32 -> bf16
    ((97, 200), 8, torch.bfloat16, torch.bfloat16),
    ((130, 257), 64, torch.float16, torch.float16),
    ((64, 128), 1, torch.float32, torch.float32),
    ((1030, 2048), 16, torch.bfloat16, torch.bfloat16),
    ((70, 192), 16, torch.float32, torch.bfloat16),
    ((40, 2085), 512, torch.bfloat16, torch.bfloat16),  # column chunks (4 MiB of packed factor), 5 edge columns
]

SCRIPT = """
import sys, torch
from lorarl.lora_merge._cpp_backend import merge
for path in sys.argv[1:]:
    w, a, b, out = torch.load(path)
    merge(w, b, a, 0.37, out)
    torch.save(out, path)
"""


def cpu_flags() -> str:
    return Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""


def avx2_machine() -> bool:
    flags = cpu_flags()
    return platform.machine() in ("x86_64", "AMD64") and " avx2 " in flags and " fma " in flags


@pytest.mark.skipif(not avx2_machine(), reason="needs an x86-64 CPU with AVX2 and FMA")
def test_kernel_for_cpus_without_avx512_matches_the_reference(tmp_path):
    inputs = []
    for i, (shape, rank, weight_dtype, out_dtype) in enumerate(CASES):
        generator = torch.Generator().manual_seed(i)
        weight = torch.randn(shape, generator=generator).to(weight_dtype)
        lora_A = torch.randn(rank, shape[1], generator=generator)
        lora_B = torch.randn(shape[0], rank, generator=generator)
        path = tmp_path / f"case{i}.pt"
        torch.save((weight, lora_A, lora_B, torch.full(shape, float("nan"), dtype=out_dtype)), path)
        inputs.append((path, weight, lora_A, lora_B))
    # a CPU without AVX-512 runs this code in its native build; built afresh here, in a cache of its own
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    if " avx512f " in cpu_flags():
        env["LORARL_MERGE_MARCH"] = "x86-64-v3"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, *(str(p) for p, *_ in inputs)], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("lorarl.lora_merge: ")]
    assert len(said) == 2, result.stderr  # once that it builds, once how long it took
    assert said[0].startswith("lorarl.lora_merge: building its C++ merge op for this machine, once (cached in ")
    assert re.fullmatch(r"lorarl.lora_merge: built in \d+ s", said[1])
    for path, weight, lora_A, lora_B in inputs:
        assert_merged_close(torch.load(path), weight, lora_A, lora_B, 0.37)

"""The throughput benchmark, run on a tiny layer so that it cannot rot unnoticed (peft's API, the backends), and its
check of the issue's targets against hand-made cases. Times are not asserted: only ratios of one run mean anything,
and those belong to the benchmark's own output."""

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

BENCHMARK = Path(__file__).parents[1] / "benchmarks" / "merge_throughput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("merge_throughput", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case(backend: str, rank: int, **metrics: float) -> dict:
    values = {"ratio_to_copy": 1.0, "ratio_to_roofline": 1.0, "speedup_vs_peft": 10.0} | metrics
    return {"backend": backend, "shape": [4096, 4096], "rank": rank, "dtype": "bf16"} | values


def test_layer_cases_run_every_backend_on_a_tiny_layer(bench, monkeypatch):
    monkeypatch.setattr(bench, "QUICK_SHAPES", [(96, 160)])
    monkeypatch.setattr(bench, "RANKS", [8])
    args = argparse.Namespace(quick=True, backends=None, factor_dtypes=list(bench.DTYPES), min_seconds=0.0, min_reps=2)
    cases = list(bench.layer_cases(args, torch.device("cpu")))
    backends = [b for b in bench.available_backends("cpu") if b != "triton"]
    combinations = {(c["backend"], c["dtype"], c["factor_dtype"]) for c in cases}
    assert {(b, d) for b, d, f in combinations if f == "fp32"} == {(b, d) for b in backends for d in bench.DTYPES}
    compiled = [b for b in backends if b != "torch"]  # every weight x factor dtype, on the compiled kernels
    assert {(b, d, f) for b, d, f in combinations if b != "torch"} == {
        (b, d, f) for b in compiled for d in bench.DTYPES for f in bench.DTYPES
    }
    for c in cases:
        assert (c["shape"], c["rank"]) == ([96, 160], 8)
        metrics = ("seconds", "gbps", "ratio_to_copy", "ratio_to_roofline", "speedup_vs_peft", "fresh_out_speedup")
        assert all(c[k] > 0 for k in metrics)
        assert c["ratio_to_roofline"] >= c["ratio_to_copy"]  # the roofline is never below the copy
    checked, _ = bench.target_misses(cases, "cpu", "cpp")
    assert checked == (len(bench.DTYPES) ** 2 if "cpp" in backends else 0)


def test_model_case_runs_on_a_tiny_model(bench):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2,
    )  # fmt: skip
    args = argparse.Namespace(min_seconds=0.0, min_reps=1)
    [case] = bench.model_case(args, torch.device("cpu"), "tiny", config, rank=4)
    assert (case["model"], case["rank"]) == ("tiny", 4)
    assert case["parameters"] == 2 * 64 * 32 + 4 * 32 * 32 + 3 * 32 * 64 + 3 * 32  # embeddings, layer, norms
    assert all(case[k] > 0 for k in ("seconds", "peft_seconds", "speedup_vs_peft", "ratio_to_preallocated"))


def test_cpu_targets_apply_to_the_default_backend_at_rank_32_or_less(bench):
    cases = [
        case("cpp", 8, ratio_to_roofline=0.79),
        case("cpp", 32, speedup_vs_peft=2.9),
        case("cpp", 16, ratio_to_roofline=0.8, speedup_vs_peft=3.0),
        case("cpp", 128, ratio_to_roofline=0.1),  # no target at rank 128
        case("torch", 8, ratio_to_roofline=0.2),  # not the default backend
    ]
    checked, misses = bench.target_misses(cases, "cpu", "cpp")
    assert checked == 3
    assert [(m["rank"], m["metric"], m["value"], m["target"]) for m in misses] == [
        (8, "ratio_to_roofline", 0.79, 0.8),
        (32, "speedup_vs_peft", 2.9, 3.0),
    ]


def test_gpu_targets_apply_to_triton_and_the_cuda_op_up_to_rank_128(bench):
    cases = [
        case("triton", 128, ratio_to_copy=0.84),
        case("cpp", 8, ratio_to_copy=0.5, ratio_to_roofline=0.1),
        case("triton", 32, ratio_to_copy=0.85),
        case("triton", 256, ratio_to_copy=0.1),
        case("torch", 8, ratio_to_copy=0.1),
    ]
    checked, misses = bench.target_misses(cases, "cuda", "cpp")
    assert checked == 3
    assert [(m["backend"], m["rank"], m["metric"]) for m in misses] == [
        ("triton", 128, "ratio_to_copy"),
        ("cpp", 8, "ratio_to_copy"),
    ]


def test_expert_cases_run_on_tiny_experts(bench, monkeypatch):
    monkeypatch.setattr(bench, "EXPERT_SHAPES", {"gate_up_proj": (48, 64)})
    monkeypatch.setattr(bench, "EXPERTS", 3)
    args = argparse.Namespace(backends=["torch", "cpp"], min_seconds=0.0, min_reps=1)
    cases = list(bench.expert_cases(args, torch.device("cpu")))
    assert [(c["backend"], c["rank"]) for c in cases] == [("torch", 8), ("cpp", 8), ("torch", 32), ("cpp", 32)]
    metrics = ("gbps", "dense_gbps", "ratio_to_dense", "speedup_vs_loop", "ratio_to_copy", "speedup_vs_peft")
    assert all(c[k] > 0 for c in cases for k in metrics)

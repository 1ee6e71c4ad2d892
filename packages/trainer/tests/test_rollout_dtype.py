"""`rollout.dtype`: which dtype the engine samples in."""

import types

import pytest
import torch

from lorarl.trainer.models import rollout_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_kept(name):
    for training in (torch.float32, torch.bfloat16):
        assert rollout_dtype(name, training, CPU) == getattr(torch, name)


def test_auto_keeps_a_half_precision_training_dtype():
    assert rollout_dtype("auto", torch.bfloat16, CPU) == torch.bfloat16
    assert rollout_dtype("auto", torch.float16, CPU) == torch.float16


@pytest.mark.parametrize("flags", [{}, {"avx512_bf16": True}, {"amx_bf16": True}, {"avx512_bf16": False}])
def test_auto_samples_float32_in_bfloat16_only_on_a_cpu_with_native_bfloat16(monkeypatch, flags):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, **flags}, raising=False)
    expected = torch.bfloat16 if any(flags.values()) else torch.float32
    assert rollout_dtype("auto", torch.float32, CPU) == expected


@pytest.mark.parametrize("torch_before_2_11", [False, True])
def test_auto_on_this_cpu_follows_its_flags(monkeypatch, torch_before_2_11):
    """Against the kernel's own report of the CPU (Linux), not torch's; also as torch < 2.11 (no
    `torch.cpu.get_capabilities`) sees it."""
    if torch_before_2_11:  # torch.cpu as it was: the AVX512-BF16 probe, no get_capabilities
        probe = torch.cpu._is_avx512_bf16_supported
        monkeypatch.setattr(torch, "cpu", types.SimpleNamespace(_is_avx512_bf16_supported=probe))
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = set(cpuinfo.read().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    native = bool({"avx512_bf16", "amx_bf16"} & flags)
    assert rollout_dtype("auto", torch.float32, CPU) == (torch.bfloat16 if native else torch.float32)

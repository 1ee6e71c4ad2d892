"""`rollout.dtype`: which dtype the engine samples in; 16-bit dtypes the CPU does not compute natively are warned of."""

import types
import warnings

import pytest
import torch
from trainer_fixtures import tiny_overrides

from lorarl.trainer.config import load_config
from lorarl.trainer.loop import Trainer
from lorarl.trainer.models import computes_natively, rollout_dtype

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


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return set(cpuinfo.read().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")


def test_this_cpu_computes_16_bit_natively_as_its_flags_say():
    """Against the kernel's report of the CPU, not torch's."""
    flags = cpu_flags()
    assert computes_natively(torch.float32, CPU)
    assert computes_natively(torch.bfloat16, CPU) == bool({"avx512_bf16", "amx_bf16"} & flags)
    assert computes_natively(torch.float16, CPU) == bool({"avx512_fp16", "amx_fp16"} & flags)
    assert computes_natively(torch.bfloat16, torch.device("cuda"))  # not the CPU's business


def slow_dtype_warnings(config) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(config)
    return [str(w.message) for w in caught if "no instructions for 16-bit matmuls" in str(w.message)]


@pytest.mark.parametrize(
    ("flags", "overrides", "named"),
    [
        ({}, {"model__dtype": "bfloat16"}, ["model.dtype=bfloat16"]),
        ({}, {"rollout__dtype": "float16"}, ["rollout.dtype=float16"]),
        (
            {},
            {"model__dtype": "bfloat16", "rollout__dtype": "float16"},
            ["model.dtype=bfloat16 and rollout.dtype=float16"],
        ),
        ({"avx512_bf16": True}, {"model__dtype": "bfloat16"}, []),
        ({"amx_fp16": True}, {"rollout__dtype": "float16"}, []),
        ({}, {}, []),  # float32, rollout.dtype=auto: float32 on this CPU
    ],
)
def test_the_trainer_warns_of_16_bit_weights_the_cpu_computes_slowly(
    monkeypatch, tiny_setup, tmp_path, flags, overrides, named
):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, **flags}, raising=False)
    config = load_config(overrides=tiny_overrides(tiny_setup, tmp_path, trainer__device="cpu", **overrides))
    messages = slow_dtype_warnings(config)
    assert [m.split(":")[0] for m in messages] == named

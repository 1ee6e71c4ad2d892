"""The step benchmark's FLOP count of an update against torch's own count of a real peft model's forward and backward
(`torch.utils.flop_counter`), so the share of the matmul peak it reports is of work the update really does."""

import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_qwen2

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import step_vs_trl
    finally:
        sys.path.remove(str(BENCHMARKS))
    return step_vs_trl


@pytest.mark.parametrize(("prompt", "response"), [(7, 11), (20, 64)])
def test_update_flops_are_what_autograd_computes(bench, tmp_path, prompt, response):
    """torch counts every matmul of the forward (the LM head at the positions that predict response tokens) and the
    backward of a LoRA model on all linear layers; eager attention computes all of its scores, so half of its batched
    matmuls are what causal attention needs. The count differs from the benchmark's by the first layer's input
    gradients, which autograd skips (no parameter below them needs one): a few percent on 4 layers, less on more."""
    from peft import LoraConfig, get_peft_model
    from torch.utils.flop_counter import FlopCounterMode

    base = tiny_qwen2(layers=4)
    base.config._attn_implementation = "eager"
    base.save_pretrained(tmp_path)
    model = get_peft_model(base, LoraConfig(r=bench.RANK, lora_alpha=bench.ALPHA, target_modules="all-linear")).train()
    sequences = 3
    inputs = torch.randint(2, 128, (sequences, prompt + response - 1))  # the last token is no input
    with FlopCounterMode(display=False) as counter:
        model(input_ids=inputs, logits_to_keep=response).logits.sum().backward()
    by_op = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    assert set(by_op) == {"aten.mm", "aten.addmm", "aten.bmm"}
    counted = by_op["aten.mm"] + by_op["aten.addmm"] + by_op["aten.bmm"] / 2
    assert bench.update_flops(tmp_path, sequences, prompt, response) == pytest.approx(counted, rel=0.04)
    assert bench.update_flops(tmp_path, sequences, prompt, response) >= counted

"""Bad input raises ValueError/TypeError naming the argument; the op's own checks guard direct torch.ops calls."""

import pytest
import torch

from lorarl.lora_merge import merge_lora, merge_lora_
from lorarl.lora_merge._cpp_backend import load_op

W = torch.randn(8, 6)
A = torch.randn(2, 6)
B = torch.randn(8, 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"),
    [
        ({"weight": W[0]}, ValueError, "weight"),
        ({"lora_A": torch.randn(2, 5)}, ValueError, "lora_A"),
        ({"lora_B": torch.randn(7, 2)}, ValueError, "lora_B"),
        ({"lora_B": torch.randn(8, 3)}, ValueError, "lora_B"),  # rank mismatch
        ({"lora_A": torch.randn(2, 8), "fan_in_fan_out": True}, ValueError, "lora_A"),
        ({"weight": W.long()}, TypeError, "weight"),
        ({"weight": W.double()}, TypeError, "weight"),
        ({"lora_A": A.int()}, TypeError, "lora_A"),
        ({"lora_B": B.bool()}, TypeError, "lora_B"),
        ({"weight": W.numpy()}, TypeError, "weight"),
        ({"lora_A": A.to("meta")}, ValueError, "lora_A"),
        ({"scale": torch.tensor(1.0)}, TypeError, "scale"),
        ({"scale": "1"}, TypeError, "scale"),
        ({"out": torch.empty(8, 5)}, ValueError, "out"),
        ({"out": torch.empty(8, 6, dtype=torch.int32)}, TypeError, "out"),
        ({"out": torch.empty(8, 6, device="meta")}, ValueError, "out"),
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"backend": "triton", "weight": W}, ValueError, "triton"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, argument, monkeypatch):
    if kwargs.get("backend") == "triton":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    call = {"weight": W, "lora_A": A, "lora_B": B, "scale": 1.0} | kwargs
    with pytest.raises(error, match=argument):
        merge_lora(call.pop("weight"), call.pop("lora_A"), call.pop("lora_B"), call.pop("scale"), **call)


def test_out_may_not_partially_overlap_its_inputs():
    storage = torch.randn(9, 6)
    weight = storage[:8]
    with pytest.raises(ValueError, match="overlaps weight"):
        merge_lora(weight, A, B, 1.0, out=storage[1:])
    with pytest.raises(ValueError, match="overlaps lora_B"):
        merge_lora(B.new_zeros(8, 2), A[:, :2], B, 1.0, out=B)
    merge_lora_(weight, A, B, 1.0)  # the very same tensor is the in-place case, allowed


def test_the_op_checks_its_arguments_when_called_directly():
    load_op(False)
    with pytest.raises(RuntimeError, match="shapes must be"):
        torch.ops.lorarl.merge_lora(W, B, torch.randn(2, 5), 1.0, torch.empty_like(W))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.lorarl.merge_lora(W.t(), torch.randn(6, 2), torch.randn(2, 8), 1.0, torch.empty(6, 8))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.lorarl.merge_lora(W.double(), B, A, 1.0, torch.empty_like(W).double())
    out = torch.empty_like(W)
    torch.ops.lorarl.merge_lora(W, B, A, 0.5, out)
    torch.testing.assert_close(out, W + 0.5 * B @ A)

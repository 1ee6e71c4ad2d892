"""Bad input raises ValueError (TypeError for non-tensors) naming the argument: never a silent wrong result."""

import pytest
import torch

from lorarl.padding import (
    from_nested,
    left_right_pad,
    pad,
    response_from_packed,
    response_from_padded,
    to_nested,
    unpad,
)

X = torch.arange(8.0).view(2, 4)
MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
PACKED = unpad(X, MASK)


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: unpad(X, MASK[:, :3]), "x"),
        (lambda: unpad(X, MASK[None]), "attention_mask"),
        (lambda: unpad(X, MASK * 0.5), "attention_mask"),
        (lambda: unpad(X, MASK * 2), "attention_mask"),
        (lambda: unpad(X[0], MASK), "x"),
        (lambda: pad(PACKED.values, PACKED.indices[:-1], 2, 4), "indices"),
        (lambda: pad(PACKED.values, PACKED.indices + 3, 2, 4), "indices"),
        (lambda: pad(PACKED.values, torch.zeros_like(PACKED.indices), 2, 4), "indices"),
        (lambda: pad(PACKED.values, PACKED.indices.float(), 2, 4), "indices"),
        (lambda: pad(PACKED.values, PACKED.indices, -1, 4), "batch"),
        (lambda: response_from_packed(PACKED.values, PACKED.cu_seqlens + 1, [1, 1]), "cu_seqlens"),
        (lambda: response_from_packed(PACKED.values, PACKED.cu_seqlens[:-1], [1]), "cu_seqlens"),
        (lambda: response_from_packed(PACKED.values, PACKED.cu_seqlens.flip(0), [1, 1]), "cu_seqlens"),
        (lambda: response_from_packed(PACKED.values, PACKED.cu_seqlens.float(), [1, 1]), "cu_seqlens"),
        (lambda: response_from_packed(PACKED.values, PACKED.cu_seqlens, [1]), "response_lens"),
        (lambda: response_from_packed(PACKED.values, PACKED.cu_seqlens, [1, -1]), "response_lens"),
        (lambda: response_from_packed(PACKED.values, PACKED.cu_seqlens, [3, 1]), "response_lens"),
        (
            lambda: response_from_packed(PACKED.values, PACKED.cu_seqlens, [2, 2], shift=0, max_response_len=1),
            "max_response_len",
        ),
        (lambda: response_from_packed(PACKED.values, PACKED.cu_seqlens, torch.tensor([1.0, 1.0])), "response_lens"),
        (lambda: response_from_packed(PACKED.values, PACKED.cu_seqlens, [1, 1], shift=-1), "shift"),
        (lambda: response_from_packed(PACKED.values, PACKED.cu_seqlens, ["a", 1]), "response_lens"),
        (lambda: response_from_padded(X[:, :3], MASK, [1, 1]), "values"),
        (lambda: response_from_padded(X, MASK.float() * 0.5, [1, 1]), "attention_mask"),
        (lambda: response_from_padded(X, MASK, [1, 2]), "response_lens"),
        (lambda: from_nested(X), "nt"),
        (lambda: from_nested(to_nested(X, MASK), side="middle"), "side"),
        (lambda: from_nested(to_nested(X, MASK), seqlen=2), "seqlen"),
        (lambda: left_right_pad([[1]], [[2], [3]]), "prompts and responses"),
        (lambda: left_right_pad([[1, 2]], [[3]], prompt_width=1), "prompt_width"),
        (lambda: left_right_pad([[1]], [[3, 4]], response_width=1), "response_width"),
        (lambda: left_right_pad([[1.5]], [[3]]), "prompts"),
        (lambda: left_right_pad([[1]], [[[3, 4]]]), "responses"),
    ],
)
def test_bad_input_names_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def test_non_tensor_inputs_are_type_errors():
    with pytest.raises(TypeError, match="attention_mask"):
        unpad(X, [[1, 1, 1, 1]])
    with pytest.raises(TypeError, match="x"):
        unpad([[1.0]], MASK)

"""Every padding function against a plain Python loop over samples, on random batches in every layout."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lorarl.padding import (
    from_nested,
    left_right_pad,
    packed_position_ids,
    pad,
    response_from_packed,
    response_from_padded,
    to_nested,
    unpad,
)

LAYOUTS = ["left", "right", "left_right", "gaps"]
GARBAGE = -777.0  # what pad positions hold: a wrong alignment shows up as this value


def columns_for(layout: str, prompt_len: int, response_len: int, width_p: int, width_r: int, rng) -> list[int]:
    """Columns of a sample's tokens (prompt then response) in a row of width `width_p + width_r`."""
    n, width = prompt_len + response_len, width_p + width_r
    if layout == "left":
        return list(range(width - n, width))
    if layout == "right":
        return list(range(n))
    if layout == "left_right":
        return list(range(width_p - prompt_len, width_p + response_len))
    return sorted(rng.sample(range(width), n))  # gaps anywhere


@st.composite
def batches(draw):
    """A padded batch `(x, mask, seqs, response_lens, shift)`; `seqs[i]` is sample i's token values, in order."""
    shift = draw(st.sampled_from([0, 1]))
    batch = draw(st.integers(1, 5))
    response_lens = draw(st.lists(st.integers(0, 5), min_size=batch, max_size=batch))
    prompt_lens = [
        max(p, shift) if r else p
        for p, r in zip(draw(st.lists(st.integers(0, 6), min_size=batch, max_size=batch)), response_lens, strict=True)
    ]
    layout = draw(st.sampled_from(LAYOUTS))
    trailing = draw(st.sampled_from([(), (3,)]))
    dtype = draw(st.sampled_from([torch.float32, torch.int64, torch.bfloat16]))
    extra = draw(st.integers(0, 3))  # columns no sample fills
    rng = random.Random(draw(st.integers(0, 2**32)))
    width_p, width_r = max(prompt_lens) + extra, max(response_lens)
    x = torch.full((batch, width_p + width_r, *trailing), GARBAGE, dtype=dtype)
    mask = torch.zeros(batch, width_p + width_r, dtype=torch.bool)
    seqs = []
    for i in range(batch):
        cols = columns_for(layout, prompt_lens[i], response_lens[i], width_p, width_r, rng)
        # small distinct integers: exact in bf16 too, so a misplaced value can never compare equal
        seq = [
            (torch.full(trailing, 16 * i + j) + (torch.arange(3) if trailing else 0)).to(dtype)
            for j in range(len(cols))
        ]
        for col, value in zip(cols, seq, strict=True):
            x[i, col], mask[i, col] = value, True
        seqs.append(seq)
    return x, mask, seqs, response_lens, shift


def reference_response(seqs, response_lens, shift, width, pad_value, like):
    """The alignment rule of DESIGN.md, one sample and one slot at a time."""
    out = torch.full((len(seqs), width, *like.shape[2:]), pad_value, dtype=like.dtype)
    for i, (seq, r) in enumerate(zip(seqs, response_lens, strict=True)):
        for k in range(r):
            out[i, k] = seq[len(seq) - r - shift + k]
    return out


@settings(max_examples=150, deadline=None)
@given(batches())
def test_unpad_then_pad_round_trips(case):
    x, mask, seqs, _, _ = case
    packed = unpad(x, mask)
    flat = [v for seq in seqs for v in seq]
    assert packed.values.shape == (len(flat), *x.shape[2:])
    for got, want in zip(packed.values, flat, strict=True):
        assert torch.equal(got, want)
    lengths = [len(s) for s in seqs]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert packed.max_seqlen == max(lengths)
    width = x.shape[1]
    assert packed.indices.tolist() == [i * width + j for i in range(len(seqs)) for j in range(width) if mask[i, j]]
    back = pad(packed.values, packed.indices, x.shape[0], width, pad_value=5)
    expected = torch.where(mask.view(*mask.shape, *[1] * (x.dim() - 2)), x, torch.tensor(5, dtype=x.dtype))
    assert torch.equal(back, expected)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_position_ids_restart_per_sample(case):
    x, mask, seqs, _, _ = case
    expected = [j for seq in seqs for j in range(len(seq))]
    assert packed_position_ids(unpad(x, mask).cu_seqlens).tolist() == expected


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from(["left", "right"]), st.integers(0, 2))
def test_nested_round_trip(case, side, extra):
    x, mask, seqs, _, _ = case
    nt = to_nested(x, mask)
    assert nt.layout == torch.jagged
    assert nt.size(0) == len(seqs)
    for i, seq in enumerate(seqs):
        got = nt[i]
        assert got.shape[0] == len(seq)
        for got_v, want in zip(got, seq, strict=True):
            assert torch.equal(got_v, want)
    width = max(len(s) for s in seqs) + extra
    padded, out_mask = from_nested(nt, side=side, pad_value=-1, seqlen=width)
    assert padded.shape == (len(seqs), width, *x.shape[2:])
    for i, seq in enumerate(seqs):
        start = 0 if side == "right" else width - len(seq)
        for j in range(width):
            inside = start <= j < start + len(seq)
            assert bool(out_mask[i, j]) == inside
            want = seq[j - start] if inside else torch.full(x.shape[2:], -1, dtype=x.dtype)
            assert torch.equal(padded[i, j], want)


@settings(max_examples=300, deadline=None)
@given(batches(), st.integers(0, 2))
def test_response_extraction_matches_loop_and_both_paths_agree(case, extra_width):
    x, mask, seqs, response_lens, shift = case
    width = max(response_lens) + extra_width
    expected = reference_response(seqs, response_lens, shift, width, -1, x)
    packed = unpad(x, mask)
    from_packed = response_from_packed(
        packed.values, packed.cu_seqlens, response_lens, shift=shift, max_response_len=width, pad_value=-1
    )
    from_padded = response_from_padded(x, mask, response_lens, shift=shift, max_response_len=width, pad_value=-1)
    assert torch.equal(from_packed, expected)
    assert torch.equal(from_padded, expected)
    assert not (from_padded == GARBAGE).any()  # never a pad position


@settings(max_examples=150, deadline=None)
@given(batches())
def test_response_extraction_accepts_int_and_float_masks_and_tensor_lengths(case):
    x, mask, _seqs, response_lens, shift = case
    expected = response_from_padded(x, mask, response_lens, shift=shift)
    for m in (mask.long(), mask.float()):
        assert torch.equal(response_from_padded(x, m, torch.tensor(response_lens), shift=shift), expected)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 50), max_size=6), min_size=1, max_size=5).flatmap(
        lambda prompts: st.tuples(
            st.just(prompts),
            st.lists(st.lists(st.integers(1, 50), max_size=5), min_size=len(prompts), max_size=len(prompts)),
        )
    ),
    st.integers(0, 2),
    st.integers(0, 2),
)
def test_left_right_pad_matches_loop(prompts_responses, extra_p, extra_r):
    prompts, responses = prompts_responses
    width_p = max(map(len, prompts)) + extra_p
    width_r = max(map(len, responses)) + extra_r
    batch = left_right_pad(prompts, responses, pad_value=0, prompt_width=width_p, response_width=width_r)
    assert batch.prompt_width == width_p
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        row = [0] * (width_p - len(p)) + p + r + [0] * (width_r - len(r))
        row_mask = [0] * (width_p - len(p)) + [1] * (len(p) + len(r)) + [0] * (width_r - len(r))
        assert batch.input_ids[i].tolist() == row
        assert batch.attention_mask[i].long().tolist() == row_mask
        assert batch.response_mask[i].long().tolist() == row_mask[width_p:]
    assert batch.prompt_lens.tolist() == list(map(len, prompts))
    assert batch.response_lens.tolist() == list(map(len, responses))
    # the same batch from tensors instead of lists
    as_tensors = left_right_pad(
        [torch.tensor(p, dtype=torch.int64) for p in prompts],
        [torch.tensor(r, dtype=torch.int32) for r in responses],
        prompt_width=width_p,
        response_width=width_r,
    )
    assert torch.equal(as_tensors.input_ids, batch.input_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_logits_shaped_values_keep_dtype_and_trailing_dim(dtype):
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11).to(dtype)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 1, 0, 0]])
    out = response_from_padded(logits, mask, [2, 3, 1])
    assert out.dtype == dtype
    assert out.shape == (3, 3, 11)
    assert torch.equal(out[0, :2], logits[0, 3:5])  # tokens at columns 2..5, response 4..5, scored from 3..4
    assert torch.equal(out[1], logits[1, 3:6])
    assert torch.equal(out[2, 0], logits[2, 3])  # tokens at 1, 3, 4: the last is scored at column 3
    assert (out[0, 2] == 0).all()
    assert (out[2, 1:] == 0).all()


@pytest.mark.parametrize("side", ["left", "right"])
def test_from_nested_handles_jagged_tensors_with_holes(side):
    grid = torch.arange(20.0).view(4, 5)
    starts, lengths = [0, 1, 2, 0], [2, 3, 0, 5]
    nt = torch.nested.narrow(grid, 1, torch.tensor(starts), torch.tensor(lengths), layout=torch.jagged)
    assert nt.lengths() is not None  # non-contiguous: the case under test
    padded, mask = from_nested(nt, side=side, pad_value=-1)
    for i, (start, n) in enumerate(zip(starts, lengths, strict=True)):
        row = grid[i, start : start + n].tolist()
        fill = [-1.0] * (5 - n)
        assert padded[i].tolist() == (row + fill if side == "right" else fill + row)
        assert mask[i].sum() == n

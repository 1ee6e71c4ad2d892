"""The bug class lorarl exists to prevent: a fixed-window slice after scattering back is only right for one layout."""

import torch

from lorarl.padding import left_right_pad, pad, response_from_packed, response_from_padded, unpad

PROMPTS = [[11, 12, 13, 14], [21], [31, 32]]
RESPONSES = [[15, 16], [22, 23, 24], [33]]


def fake_logp(tokens: torch.Tensor) -> torch.Tensor:
    """A per-position value that identifies the token it was computed at (position j 'scores' token j+1)."""
    return tokens.double() * 0.01


def truth() -> torch.Tensor:
    """Per response token: the value computed at the position before it, by a loop over samples."""
    width = max(map(len, RESPONSES))
    out = torch.zeros(len(PROMPTS), width, dtype=torch.float64)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        seq = p + r
        for k in range(len(r)):
            out[i, k] = seq[len(p) + k - 1] * 0.01
    return out


def right_padded() -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt and response back to back, pads at the end (what a plain tokenizer with padding_side='right' gives)."""
    width = max(len(p) for p in PROMPTS) + max(len(r) for r in RESPONSES)
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.int64)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        ids[i, : len(p + r)] = torch.tensor(p + r)
        mask[i, : len(p + r)] = True
    return ids, mask


def fixed_window(ids: torch.Tensor, mask: torch.Tensor, width_r: int) -> torch.Tensor:
    """What verl-style code did: forward on the packed batch, scatter back, slice the last R+1..1 columns."""
    packed = unpad(ids, mask)
    back = pad(fake_logp(packed.values), packed.indices, *ids.shape)
    return back[:, -width_r - 1 : -1]


def test_fixed_window_slice_is_misaligned_for_right_padded_prompts():
    ids, mask = right_padded()
    response_lens = [len(r) for r in RESPONSES]
    sliced = fixed_window(ids, mask, max(response_lens))
    response_mask = torch.arange(3)[None, :] < torch.tensor(response_lens)[:, None]
    assert not torch.equal(sliced * response_mask, truth())  # the bug: wrong tokens scored

    packed = unpad(ids, mask)
    ours_packed = response_from_packed(fake_logp(packed.values), packed.cu_seqlens, response_lens)
    ours_padded = response_from_padded(fake_logp(ids), mask, response_lens)
    assert torch.equal(ours_packed, truth())
    assert torch.equal(ours_padded, truth())


def test_fixed_window_is_only_right_for_the_left_right_layout_and_ours_agree_there_too():
    batch = left_right_pad(PROMPTS, RESPONSES)
    response_lens = batch.response_lens
    sliced = fixed_window(batch.input_ids, batch.attention_mask, batch.response_mask.shape[1])
    assert torch.equal(sliced * batch.response_mask, truth())

    packed = unpad(batch.input_ids, batch.attention_mask)
    ours_packed = response_from_packed(fake_logp(packed.values), packed.cu_seqlens, response_lens)
    assert torch.equal(ours_packed, truth())
    assert torch.equal(response_from_padded(fake_logp(batch.input_ids), batch.attention_mask, response_lens), truth())

"""Log-probs from the packed batch equal those of each sample run alone (no cross-sample attention), and match the
same values extracted from a padded forward."""

import pytest
import torch
from tiny_models import tiny_gpt2, tiny_qwen2

from lorarl.padding import left_right_pad, response_from_padded
from lorarl.trainer.logprobs import micro_batches, pack, response_logprobs

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
RESPONSES = [[10, 11], [12, 13, 14, 15], []]


@pytest.mark.parametrize("make", [tiny_qwen2, tiny_gpt2])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_packed_equals_each_sample_alone(make, attention):
    model = make()
    model.config._attn_implementation = attention
    with torch.no_grad():
        logp, entropy = response_logprobs(model, pack(PROMPTS, RESPONSES, 4, "cpu"), temperature=0.7, entropy=True)
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
            logits = model(input_ids=torch.tensor([p + r]), use_cache=False).logits[0].float() / 0.7
            alone = torch.log_softmax(logits, -1)
            for k, token in enumerate(r):
                assert logp[i, k].item() == pytest.approx(alone[len(p) - 1 + k, token].item(), abs=1e-5)
                expected_entropy = -(alone[len(p) - 1 + k].exp() * alone[len(p) - 1 + k]).sum()
                assert entropy[i, k].item() == pytest.approx(expected_entropy.item(), abs=1e-5)
            assert (logp[i, len(r) :] == 0).all()


def test_packed_equals_the_padded_forward_aligned_by_padding():
    model = tiny_qwen2()
    batch = left_right_pad(PROMPTS, RESPONSES)
    with torch.no_grad():
        packed, _ = response_logprobs(model, pack(PROMPTS, RESPONSES, 4, "cpu"))
        mask = batch.attention_mask.long()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        token_logp = torch.log_softmax(logits.float(), -1).gather(2, batch.input_ids.roll(-1, 1)[:, :, None])[:, :, 0]
        padded = response_from_padded(token_logp, batch.attention_mask, batch.response_lens, max_response_len=4)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)


def test_micro_batches_bound_tokens():
    assert list(micro_batches([5, 5, 5, 20, 1], 10)) == [[0, 1], [2], [3], [4]]

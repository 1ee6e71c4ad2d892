"""Response log-probs and entropies, in either micro-batch layout, equal those of each sample run alone through the
plain model (full logits, log-softmax) — values, and the gradients they give the LoRA parameters."""

import itertools
import random

import pytest
import torch
from tiny_models import tiny_gpt2, tiny_qwen2

from lorarl.trainer.logprobs import micro_batch, micro_batches, resolve_layout, response_logprobs

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [3, 1], [1, 2, 3, 4], [5, 6], [1, 2, 3, 4]]  # prompts repeat, as in groups
RESPONSES = [[10, 11], [12, 13, 14, 15], [], [9, 9, 9], [4], [15, 14], [10, 12, 3]]
WIDTH = 5  # wider than the longest response: the slots past it stay zero
LAYOUTS = {"packed": ("packed", False), "padded": ("padded", False), "padded-shared-prompts": ("padded", True)}


def build(prompts, responses, layout_id):
    layout, share = LAYOUTS[layout_id]
    return micro_batch(prompts, responses, WIDTH, "cpu", layout, share_prompts=share)


def alone(model, prompt, response, temperature):
    """Per response token: (log p, entropy) from the sample's own full logits."""
    logits = model(input_ids=torch.tensor([prompt + response]), use_cache=False).logits[0].float() / temperature
    log_p = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(response)]
    return log_p.gather(1, torch.tensor(response, dtype=torch.long)[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)


def lora(model, *, head: bool = False):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    targets = ["q_proj", "v_proj", "down_proj", *(["lm_head"] if head else [])]
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("make", [tiny_qwen2, tiny_gpt2])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_each_layout_equals_each_sample_alone(layout, make, attention):
    model = make()
    model.config._attn_implementation = attention
    with torch.no_grad():
        logp, entropy = response_logprobs(model, build(PROMPTS, RESPONSES, layout), temperature=0.7)
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
            want_logp, want_entropy = alone(model, p, r, 0.7)
            torch.testing.assert_close(logp[i, : len(r)], want_logp, atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[i, : len(r)], want_entropy, atol=1e-5, rtol=0)
            assert (logp[i, len(r) :] == 0).all()
            assert (entropy[i, len(r) :] == 0).all()


@pytest.mark.parametrize("head", [False, True], ids=["plain-head", "lora-on-the-head"])
def test_gradients_of_both_layouts_equal_the_per_sample_loop(head):
    """The LoRA gradient of sum(w · log p + v · entropy) over micro-batches, against one sample at a time. With an
    adapter on the LM head the head is no plain Linear: that path scores the full logits of the micro-batch."""
    model = lora(tiny_qwen2(), head=head)
    g = torch.Generator().manual_seed(2)
    w, v = torch.randn(len(PROMPTS), WIDTH, generator=g), torch.randn(len(PROMPTS), WIDTH, generator=g)
    params = [p for p in model.parameters() if p.requires_grad]

    def gradients(losses):
        model.zero_grad()
        sum(losses).backward()
        return [p.grad.clone() for p in params]

    def loss(logp, entropy, rows):
        return (logp * w[rows, : logp.shape[1]]).sum() + (entropy * v[rows, : entropy.shape[1]]).sum()

    want = gradients([loss(*[x[None] for x in alone(model, p, r, 0.8)], [i]) for i, (p, r) in
                      enumerate(zip(PROMPTS, RESPONSES, strict=True)) if r])  # fmt: skip
    for layout in LAYOUTS if not head else ("packed", "padded"):  # a LoRA head is scored from the full logits
        losses = []
        lengths = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
        for rows in micro_batches(lengths, 20, LAYOUTS[layout][0]):
            micro = build([PROMPTS[i] for i in rows], [RESPONSES[i] for i in rows], layout)
            losses.append(loss(*response_logprobs(model, micro, temperature=0.8), rows))
        for a, e in zip(gradients(losses), want, strict=True):
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4, msg=layout)


def test_the_head_is_restored_after_a_failing_forward():
    model = tiny_qwen2()
    micro = micro_batch(PROMPTS, RESPONSES, WIDTH, "cpu", "padded")
    micro.inputs["input_ids"] = micro.inputs["input_ids"] + 1000  # out of the vocabulary
    with pytest.raises(IndexError):
        response_logprobs(model, micro)
    assert "forward" not in vars(model.get_output_embeddings())


def test_packed_micro_batches_bound_tokens_in_order():
    assert list(micro_batches([5, 5, 5, 20, 1], 10, "packed")) == [[0, 1], [2], [3], [4]]


def test_padded_micro_batches_group_similar_lengths_and_bound_rows_times_the_longest():
    lengths = [3, 9, 4, 9, 2, 8, 3]
    batches = list(micro_batches(lengths, 18, "padded"))
    assert batches == [[1, 3], [5, 2], [0, 6, 4]]
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 18 for b in batches)
    assert list(micro_batches([30, 2], 18, "padded")) == [[0], [1]]  # a sample longer than the bound goes alone


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_micro_batches_are_the_fewest_and_as_even_as_they_can_be(layout):
    """16 samples of 268 tokens within 4096: two micro-batches of 8 (filling the first would leave 15 and 1, and the
    activations' memory of 15); against every split into as many micro-batches, by brute force on small cases."""
    assert micro_batches([268] * 16, 4096, layout) == [list(range(8)), list(range(8, 16))]
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 9) for _ in range(rng.randint(1, 7))]
        bound = rng.randint(9, 30)
        got = micro_batches(lengths, bound, layout)
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if layout == "padded" else range(len(lengths))
        assert [i for b in got for i in b] == list(order)

        def cost(rows, lengths=lengths):
            return len(rows) * max(lengths[i] for i in rows) if layout == "padded" else sum(lengths[i] for i in rows)

        splits = [split for split in _contiguous_splits(list(order)) if all(cost(b) <= bound for b in split)]
        fewest = min(map(len, splits))
        assert len(got) == fewest
        assert max(map(cost, got)) == min(max(map(cost, s)) for s in splits if len(s) == fewest)


def _contiguous_splits(items):
    """Every way to cut `items` into consecutive groups."""
    for cuts in itertools.product([False, True], repeat=len(items) - 1):
        split, group = [], [items[0]]
        for item, cut in zip(items[1:], cuts, strict=True):
            if cut:
                split.append(group)
                group = []
            group.append(item)
        yield [*split, group]


def test_auto_layout_packs_only_for_flash_attention():
    model = tiny_qwen2()
    assert resolve_layout("auto", model) == "padded"
    model.config._attn_implementation = "flash_attention_2"
    assert resolve_layout("auto", model) == "packed"
    assert resolve_layout("padded", model) == "padded"
    with pytest.raises(ValueError, match="layout"):
        resolve_layout("jagged", model)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_bfloat16_autocast_follows_float32(layout):
    """`actor.autocast=bfloat16` (the forward under torch.autocast, float32 weights): the log-probs within bf16's
    precision of float32's, and the LoRA gradient of sum(w · log p) pointing the same way, kept in float32."""
    model = lora(tiny_qwen2())
    micro = build(PROMPTS, RESPONSES, layout)
    params = [p for p in model.parameters() if p.requires_grad]
    w = torch.randn(len(PROMPTS), WIDTH, generator=torch.Generator().manual_seed(3))

    def run(autocast: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp, _ = response_logprobs(model, micro, temperature=1.0)
        (logp * w).sum().backward()
        return logp.detach().float(), torch.cat([p.grad.flatten() for p in params])

    (want, want_grad), (got, grad) = run(False), run(True)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params)
    assert 0 < (got - want).abs().max() < 0.01  # bf16 did compute them
    assert torch.nn.functional.cosine_similarity(grad, want_grad, dim=0) > 0.999

"""What the embedded models' pre-training scripts share: the small Qwen2-style model, and one supervised step."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def small_qwen2(tokenizer, *, vocab_size: int, max_positions: int) -> Qwen2ForCausalLM:
    """A 0.6M-parameter Qwen2-style model (3 layers of width 128, tied embeddings) for `tokenizer`."""
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=True, rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def sft_step(model, optimizer: torch.optim.Optimizer, ids: torch.Tensor, labels: torch.Tensor, *, pad: int,
             lr: float) -> torch.Tensor:  # fmt: skip
    """One optimizer step on the cross-entropy of `labels` (-100: no loss) at learning rate `lr`; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    model.train()
    loss = model(input_ids=ids, attention_mask=(ids != pad).long(), labels=labels).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss

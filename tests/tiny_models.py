"""Tiny random models built in code (no downloads), importable by tests and by the processes they spawn."""

import torch


def tiny_qwen2(*, tie: bool = True, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2):
    """A random Qwen2 (Llama-style: GQA, gate/up/down MLP, RMSNorm, q/k/v biases) with a few thousand parameters."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    return Qwen2ForCausalLM(config).to(dtype).eval()


def tiny_gpt2(*, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random GPT-2: its projections are `Conv1D` (weights stored [in, out], peft's fan_in_fan_out)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=128, n_positions=256, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).to(dtype).eval()


def tiny_lora_qwen2(*, rank: int = 8, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """`tiny_qwen2` with a random (non-zero) LoRA adapter on every linear layer."""
    from peft import LoraConfig, get_peft_model

    model = tiny_qwen2(dtype=dtype, seed=seed)
    torch.manual_seed(seed + 1)
    return get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    )


def tiny_moe(
    family: str = "qwen3_moe",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    layers: int = 2,
    experts: int = 8,
    **overrides: int,
):
    """A random mixture of experts, top-2 routing by `mlp.gate`; transformers 5 fuses its experts into 3-D
    parameters, `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]. `family`: "qwen3_moe",
    or "qwen2_moe" (a shared expert beside the routed ones, `mlp.shared_expert`, weighed by its own sigmoid gate
    `mlp.shared_expert_gate`). `overrides`: other config values (e.g. `moe_intermediate_size`)."""
    import transformers

    torch.manual_seed(seed)
    values = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }
    values |= {"qwen3_moe": {"head_dim": 16}, "qwen2_moe": {"shared_expert_intermediate_size": 64}}[family]
    name = {"qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe"}[family]
    config = getattr(transformers, f"{name}Config")(**(values | overrides))
    return getattr(transformers, f"{name}ForCausalLM")(config).to(dtype).eval()

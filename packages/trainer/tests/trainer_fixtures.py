"""Helpers of the trainer tests: a tiny random model with the in-code character tokenizer, prompt files, a learnable
reward, and the settings of a short run."""

import json
from pathlib import Path

import torch

from lorarl.trainer import default_task
from lorarl.trainer.engines import SamplingParams

REWARD_FILE = '''
def sevens(prompt, response, answer):
    """The share of 7s in the response: a random policy can learn to say 7."""
    return response.count("7") / max(len(response), 1)


def has_seven(prompt, response, answer):
    """1 if the response says 7 at all: a binary reward, so whole groups often agree (what dynamic sampling drops)."""
    return float("7" in response)
'''


def make_model_dir(directory: Path, seed: int = 0) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = default_task.build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    # larger (tied) embeddings than HF's 0.02-std init, which with the final norm caps every
    # logit near +-0.6, so no adapter on the layers could make any token likely
    torch.nn.init.normal_(model.get_input_embeddings().weight, std=0.15)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def make_moe_model_dir(directory: Path, family: str = "qwen3_moe", seed: int = 0, **overrides: int) -> Path:
    """A tiny random mixture of experts with the character tokenizer, as `make_model_dir`'s: Qwen3-MoE (8 fused
    experts, top-2) or Qwen2-MoE (the same beside a shared expert and its gate); heads of 32, as vLLM's CPU attention
    takes them. `overrides`: other config values."""
    from tiny_models import tiny_moe

    tokenizer = default_task.build_tokenizer()
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None}
    shape = {"vocab_size": 16, "hidden_size": 32, "num_attention_heads": 1, "num_key_value_heads": 1,
             "moe_intermediate_size": 32, "max_position_embeddings": 64} | overrides  # fmt: skip
    model = tiny_moe(family, seed=seed, **shape, **({"head_dim": 32} if family == "qwen3_moe" else {}), **ids)
    torch.nn.init.normal_(model.get_input_embeddings().weight, std=0.05)  # near-uniform samples: 7s to learn from
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def make_tiny_setup(root: Path) -> dict[str, str]:
    model = make_model_dir(root / "model")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(20) for b in range(20)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:300]))
    (root / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[300:332]))
    (root / "sevens.py").write_text(REWARD_FILE)
    return {"model": str(model), "train": str(root / "train.jsonl"), "val": str(root / "val.jsonl"),
            "reward": f"{root / 'sevens.py'}:sevens", "binary_reward": f"{root / 'sevens.py'}:has_seven"}  # fmt: skip


def tiny_overrides(setup: dict[str, str], output_dir: Path, **extra) -> list[str]:
    """Settings of a short, fast run on the tiny model (extra: dotted keys with '__' for '.')."""
    overrides = {
        "model.path": setup["model"],
        "model.lora.rank": 8,
        "data.train_files": f"[{setup['train']}]",
        "data.val_files": f"[{setup['val']}]",
        "data.batch_size": 8,
        "rollout.n": 4,
        "rollout.max_tokens": 6,
        "reward.fn": setup["reward"],
        "actor.lr": 2e-2,
        "trainer.steps": 12,
        "trainer.eval_every": 0,
        "trainer.output_dir": str(output_dir),
        "trainer.threads": 1,  # a run repeats bit for bit whatever else the machine runs (threads.py); one per worker
    }
    overrides.update({key.replace("__", "."): value for key, value in extra.items()})
    return [f"{key}={value}" for key, value in overrides.items()]


def write_gguf(model_dir: Path, name: str = "tiny.gguf", quantized: bool = False) -> Path:
    """The tiny Qwen2 model as a GGUF file beside it, written with the gguf package under llama.cpp's tensor names
    (float32, or Q8_0 for the 2-D weights with `quantized`), as llama.cpp's converter lays one out."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    c = model.config
    writer = gguf.GGUFWriter(str(model_dir / name), "qwen2")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, c.num_hidden_layers)
    tensors = dict(model.state_dict())
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])  # tied: llama.cpp writes it out
    for hf_name, tensor in tensors.items():
        module, suffix = hf_name.rsplit(".", 1)
        data = tensor.float().numpy()
        if quantized and data.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(f"{names.get_name(module)}.{suffix}", gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(f"{names.get_name(module)}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model_dir / name


def make_adapter_nonzero(model) -> None:
    """Random LoRA B factors, as training makes them (peft starts them at zero, where adapter and base agree)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3, generator=torch.Generator(device=p.device).manual_seed(len(name)))


def greedy_after_sync(trainer, prompts: list, *, version: int, kind: str) -> list:
    """The trainer's weights synced into its engine (`kind`: adapter, merged or base), then greedy completions."""
    trainer.weights.sync(version=version, kind=kind)
    return trainer.engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=6))


def served_merged_served(trainer) -> tuple[list, list, list]:
    """With a trained-looking adapter, as version 3: greedy completions with the adapter served unmerged, with the same
    weights merged, then with the base weights synced back and the adapter served on them again."""
    trainer.start_engine()
    try:
        trainer.weights.sync()
        make_adapter_nonzero(trainer.model)
        prompts = [e.prompt_ids for e in trainer.rollouts.examples[:6]]
        served = greedy_after_sync(trainer, prompts, version=3, kind="adapter")
        assert trainer.engine.version == 3
        merged = greedy_after_sync(trainer, prompts, version=3, kind="merged")  # the same weights, merged this time
        trainer.weights.sync(version=3, kind="base")  # and back: the base weights, then the adapter served on them
        again = greedy_after_sync(trainer, prompts, version=3, kind="adapter")
    finally:
        trainer.engine.close()
    return served, merged, again


def assert_same_completions(got: list, expected: list) -> None:
    """The same tokens, log-probs within float32 noise (the adapter served unmerged against the merged weights)."""
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-5)

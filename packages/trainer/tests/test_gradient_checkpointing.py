"""`actor.gradient_checkpointing`: the layers keep their inputs instead of their activations and recompute them in the
backward — the same gradients as the plain forward, far less saved for the backward, the responses of a group still
sharing their prompt's KV cache — and a trainer step with it is the step without it."""

import pytest
import torch
from torch import nn
from trainer_fixtures import make_model_dir, tiny_overrides

from lorarl.trainer.config import load_config
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.logprobs import micro_batch, response_logprobs
from lorarl.trainer.loop import Trainer
from lorarl.trainer.models import DTYPES, LoraSection, _with_adapter, load_base
from lorarl.trainer.presets import PRESETS
from lorarl.trainer.recompute import checkpoint_layers


def policy(model_dir, dtype: str) -> nn.Module:
    torch.manual_seed(0)  # peft draws A from the global generator
    model = _with_adapter(
        load_base(model_dir, DTYPES[dtype], torch.device("cpu")), LoraSection(rank=4), key="model.lora"
    )
    with torch.no_grad():  # B away from its zero init, so that A gets gradients too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model.train()


def gradients(model: nn.Module, share_prompts: bool) -> tuple[dict[str, torch.Tensor], int, int]:
    """The LoRA gradients of a weighted sum of response log-probs, the bytes autograd saved for the backward, and
    how many times the decoder layers' MLPs ran."""
    samples = [((3, 4, 5, 6), (10, 11, 12)), ((3, 4, 5, 6), (12, 11)), ((7, 8, 9), (13, 14, 15, 11))]
    prompts, responses = [p for p, _ in samples], [r for _, r in samples]
    micro = micro_batch(prompts, responses, 4, torch.device("cpu"), "padded", share_prompts=share_prompts)
    calls = []
    # a pre-hook: the recompute stops once it has what the backward needs, before the layer (or its MLP) returns
    layers = model.base_model.model.model.layers
    hooks = [layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in layers]
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logp, _ = response_logprobs(model, micro)
    weights = torch.linspace(-1.0, 1.0, logp.numel()).view_as(logp)
    model.zero_grad()
    (logp * weights).sum().backward()
    for hook in hooks:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return grads, sum(saved), len(calls)


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16 on CPU: cpu_attention's own recompute nested inside
def test_checkpointed_layers_give_the_gradients_of_the_plain_forward_and_save_less(tmp_path, dtype, share_prompts):
    model_dir = make_model_dir(tmp_path / "model")
    plain, plain_saved, plain_calls = gradients(policy(model_dir, dtype), share_prompts)
    model = policy(model_dir, dtype)
    checkpoint_layers(model)
    checkpointed, saved, calls = gradients(model, share_prompts)
    assert plain.keys() == checkpointed.keys()
    assert any("lora_A" in n for n in plain)
    for name, grad in plain.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-6, atol=1e-8, msg=name)
    layers = len(model.base_model.model.model.layers)
    # the responses' forward runs each layer again in the backward; the prompts' forward (it fills the cache) does not
    forwards = 2 if share_prompts else 1
    assert (plain_calls, calls) == (forwards * layers, (forwards + 1) * layers)
    assert saved < plain_saved * (0.6 if share_prompts else 0.2), (saved, plain_saved)


def test_a_step_with_gradient_checkpointing_is_the_step_without(tiny_setup, tmp_path):
    trained = []
    for flag in (False, True):
        overrides = tiny_overrides(tiny_setup, tmp_path / str(flag), actor__gradient_checkpointing=flag,
                                   actor__layout="padded")  # fmt: skip
        trainer = Trainer(load_config(None, overrides, presets=PRESETS))
        assert trainer.actor.share_prompts  # the responses share their prompt's KV cache, checkpointed or not
        trainer.start_engine()
        try:
            trainer.weights.sync()
            metrics = trainer.train_step(1)
        finally:
            trainer.engine.close()
        assert metrics["grad_norm"] > 0
        trained.append([p.detach().clone() for p in trainer.policy.trainable()])
    for plain, checkpointed in zip(*trained, strict=True):
        assert torch.equal(plain, checkpointed)


def test_a_model_without_gradient_checkpointing_is_refused_by_name():
    with pytest.raises(TrainerError, match=r"actor.gradient_checkpointing=true: Linear has no decoder layers"):
        checkpoint_layers(nn.Linear(2, 2))

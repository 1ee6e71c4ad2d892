"""`actor.gradient_checkpointing`: the layers keep their inputs instead of their activations and recompute them in the
backward — the same gradients as the plain forward, far less saved for the backward — and a trainer step with it is
the step without it."""

import pytest
import torch
from torch import nn
from trainer_fixtures import make_model_dir, tiny_overrides

from lorarl.trainer.config import load_config
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.logprobs import micro_batch, response_logprobs
from lorarl.trainer.loop import Trainer
from lorarl.trainer.models import DTYPES, LoraSection, _with_adapter, checkpoint_layers, load_base
from lorarl.trainer.presets import PRESETS


def policy(model_dir, dtype: str) -> nn.Module:
    torch.manual_seed(0)  # peft draws A from the global generator
    model = _with_adapter(load_base(model_dir, DTYPES[dtype], torch.device("cpu")), LoraSection(rank=4))
    with torch.no_grad():  # B away from its zero init, so that A gets gradients too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model.train()


def gradients(model: nn.Module) -> tuple[dict[str, torch.Tensor], int, int]:
    """The LoRA gradients of a weighted sum of response log-probs, the bytes autograd saved for the backward, and
    how many times the decoder layers' MLPs ran."""
    samples = [((3, 4, 5, 6), (10, 11, 12)), ((3, 4, 5, 6), (12, 11)), ((7, 8, 9), (13, 14, 15, 11))]
    micro = micro_batch([p for p, _ in samples], [r for _, r in samples], 4, torch.device("cpu"), "padded")
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16 on CPU: cpu_attention's own recompute nested inside
def test_checkpointed_layers_give_the_gradients_of_the_plain_forward_and_save_less(tmp_path, dtype):
    model_dir = make_model_dir(tmp_path / "model")
    plain, plain_saved, plain_calls = gradients(policy(model_dir, dtype))
    model = policy(model_dir, dtype)
    checkpoint_layers(model)
    checkpointed, saved, calls = gradients(model)
    assert plain.keys() == checkpointed.keys()
    assert any("lora_A" in n for n in plain)
    for name, grad in plain.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-6, atol=1e-8, msg=name)
    layers = len(model.base_model.model.model.layers)
    assert (plain_calls, calls) == (layers, 2 * layers)  # each layer ran again in the backward
    assert saved < plain_saved / 2, (saved, plain_saved)


def test_a_step_with_gradient_checkpointing_is_the_step_without(tiny_setup, tmp_path):
    trained = []
    for flag in (False, True):
        overrides = tiny_overrides(tiny_setup, tmp_path / str(flag), actor__gradient_checkpointing=flag,
                                   actor__layout="padded")  # fmt: skip
        trainer = Trainer(load_config(None, overrides, presets=PRESETS))
        # a checkpointed layer drops a KV cache, so the responses do not share their prompt's; neither do these
        assert trainer.actor.share_prompts is False if flag else trainer.actor.share_prompts
        trainer.actor.share_prompts = False
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
    with pytest.raises(TrainerError, match=r"actor.gradient_checkpointing=true: Linear does not support"):
        checkpoint_layers(nn.Linear(2, 2))

"""Many LoRA training runs on one frozen base: each run (a tenant) is a peft adapter of its own on the one model, with
its own optimizer state; a forward runs with exactly one run's adapter active, so each run's gradients are those it
would get alone. Sampler snapshots are adapters too (copies, frozen), which the sampler activates the same way.

Why adapters by name on one `PeftModel` rather than a model per run: the base's weights are most of the memory, and
an adapter of rank r on a 135M model is well under 1% of it — four runs cost about what one does."""

import contextlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from lorarl.trainer.head_logprobs import head_logprobs, head_replaced
from lorarl.trainer.logprobs import micro_batches
from lorarl.trainer.models import (
    Mixture,
    adapters,
    adapts_fused_experts,
    load_base,
    load_tokenizer,
    resolve_model_path,
)
from lorarl.trainer.serve.losses import LOSSES

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2")
ALPHA = 32  # Tinker's LoRA scaling is alpha / rank with alpha 32, whatever the rank


class RequestError(ValueError):
    """A request the server cannot run as asked: the client's to fix (the API's `user` error category)."""


class NotFound(LookupError):
    """A session, run, sampling session or request the client named that the server does not hold (HTTP 404, the
    `user` category: any other LookupError is the server's own failure)."""


class SessionFinished(NotFound):
    """A request to a session that has finished (HTTP 410, which ends the SDK's heartbeat)."""


@dataclass(frozen=True)
class LoraShape:
    """Which layers a run's adapter covers, and its rank (the API's `LoraConfig`)."""

    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False
    seed: int | None = None

    def __post_init__(self):
        if self.rank < 1:
            raise RequestError(f"lora_config.rank: expected >= 1, got {self.rank}")


@dataclass
class Datum:
    """One training sequence: `tokens` in, `targets` (as long) predicted, and the loss's per-token inputs."""

    tokens: list[int]
    targets: Tensor  # [L] or [L, K] int64 (K targets scored at each position: distillation)
    inputs: dict[str, Tensor]  # name -> [L] float32 (weights, logprobs, advantages...)


class SharedBase:
    """The base model, loaded once, and every adapter on it (training runs' and sampler snapshots')."""

    def __init__(self, name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                 micro_batch_tokens: int = 4096):  # fmt: skip
        self.name = name
        self.path = resolve_model_path(name)
        self.tokenizer = load_tokenizer(self.path)
        self.device, self.dtype = device, dtype
        self.micro_batch_tokens = micro_batch_tokens
        self.base = load_base(self.path, dtype, device).requires_grad_(False)
        self.model: nn.Module | None = None  # the PeftModel, once the first adapter exists
        self.vocab_size = int(self.base.get_output_embeddings().weight.shape[0])
        self.linears = {name.rsplit(".", 1)[-1] for name, m in self.base.named_modules() if isinstance(m, nn.Linear)}
        mixture = Mixture.of(self.base)  # a mixture of experts: its routers are never adapted, its experts with the MLP
        self.linears -= {name.rsplit(".", 1)[-1] for name in mixture.routers}
        self.experts = sorted({".".join(name.split(".")[-2:]) for name in mixture.experts})  # e.g. experts.down_proj

    def target_modules(self, shape: LoraShape) -> list[str]:
        wanted = (ATTENTION if shape.train_attn else ()) + (MLP if shape.train_mlp else ())
        targets = [t for t in wanted if t in self.linears]
        if shape.train_unembed:
            targets.append("lm_head")
        if not targets and not (shape.train_mlp and self.experts):
            raise RequestError(f"lora_config {shape}: no layer of {self.name} to train (train_attn, train_mlp or "
                               "train_unembed)")  # fmt: skip
        return targets

    def lora_config(self, shape: LoraShape):
        """peft's `LoraConfig` of an adapter of `shape` on this base."""
        from peft import LoraConfig

        if shape.rank < 1:
            raise RequestError(f"lora_config.rank must be >= 1, got {shape.rank}")
        experts = self.experts if shape.train_mlp else None  # fused experts: peft's target_parameters
        return LoraConfig(r=shape.rank, lora_alpha=ALPHA, target_modules=self.target_modules(shape),
                          target_parameters=experts, lora_dropout=0.0)  # fmt: skip

    @property
    def mixes_adapters(self) -> bool:
        """Whether one forward can serve rows of several adapters (peft's mixed batches): not where an adapter is
        on fused experts (peft's `ParamWrapper` has no mixed batches), whose rows then decode adapter by adapter."""
        return self.model is None or not adapts_fused_experts(self.model)

    def add_adapter(self, name: str, shape: LoraShape) -> list[nn.Parameter]:
        """A new adapter `name` of `shape` (B = 0: the base's outputs at first), initialised from `shape.seed` where
        given; returns its trainable parameters."""
        from peft import get_peft_model

        config = self.lora_config(shape)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # peft warns of an adapted head tied to the embeddings, for merging: adapters here are never merged
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            if shape.seed is not None:
                torch.manual_seed(shape.seed)
            if self.model is None:  # in eval mode: no dropout, and peft routes mixed batches only there
                self.model = get_peft_model(self.base, config, adapter_name=name).eval()
            else:
                self.model.add_adapter(name, config)
            active = self.model.active_adapter  # peft's own; left naming a deleted adapter once all were removed
            if not isinstance(active, str) or active not in self.model.peft_config:
                self.model.active_adapter = name
        params = list(self.factors(name).values())
        for p in params:
            p.requires_grad_(True)  # peft adds an adapter that is not the active one frozen
        return params

    def remove_adapter(self, name: str) -> None:
        if self.model is not None and name in self.model.peft_config:
            self.model.delete_adapter(name)

    def factors(self, name: str) -> dict[str, nn.Parameter]:
        """Adapter `name`'s factors, in the model's order, keyed by their names with the adapter's name taken out."""
        marker = f".{name}."
        return {n.replace(marker, "."): p for n, p in self.model.named_parameters() if marker in n and "lora_" in n}

    def adapter_tensors(self, name: str) -> dict[str, Tensor]:
        """Copies of adapter `name`'s factors (`factors`' names)."""
        return {key: p.detach().clone() for key, p in self.factors(name).items()}

    def load_adapter_tensors(self, name: str, tensors: dict[str, Tensor], *, share: bool = False) -> None:
        """Copy `tensors` (as `adapter_tensors` names them) into adapter `name`, every shape checked first; `share`:
        the adapter's (frozen) factors become those tensors themselves — a sampler snapshot loaded costs no copy."""
        own = self.factors(name)
        if set(own) != set(tensors):
            raise RequestError(f"the weights do not fit this adapter: {len(set(tensors) ^ set(own))} tensor names "
                               "differ (another base model or LoRA config?)")  # fmt: skip
        for key, p in own.items():
            if tuple(tensors[key].shape) != tuple(p.shape):
                raise RequestError(f"the weights do not fit this adapter: {key} is {tuple(tensors[key].shape)}, "
                                   f"expected {tuple(p.shape)} (another rank?)")  # fmt: skip
        with torch.no_grad():
            for key, p in own.items():
                if share:
                    p.requires_grad_(False).data = tensors[key]
                else:
                    p.copy_(tensors[key])

    def active(self, name: str | None):
        """A context computing with adapter `name` alone (None: the base model)."""
        if self.model is None:
            return contextlib.nullcontext(self.base)
        return adapters(self.model, None if name is None else [name])

    def target_logprobs(self, adapter: str | None, data: list[Datum]) -> Iterator[tuple[list[int], Tensor]]:
        """Per micro-batch: the indices of its data and their targets' log-probs `[tokens]` (concatenated in that
        order), under `adapter`, differentiable when grad is enabled."""
        lengths = [len(d.tokens) for d in data]
        model = self.model if self.model is not None else self.base
        with self.active(adapter):
            for batch in micro_batches(lengths, self.micro_batch_tokens, layout="padded"):
                per_position = [data[i].targets.reshape(lengths[i], -1) for i in batch]
                if len({t.shape[1] for t in per_position}) > 1:  # scored in one pass: one K per micro-batch
                    parts = [self._batch_logprobs(model, [data[i]]) for i in batch]
                    yield batch, torch.cat(parts)
                    continue
                yield batch, self._batch_logprobs(model, [data[i] for i in batch])

    def _batch_logprobs(self, model: nn.Module, data: list[Datum]) -> Tensor:
        """The targets' log-probs of `data` (one micro-batch, right-padded), concatenated datum by datum."""
        lengths = [len(d.tokens) for d in data]
        ids = torch.zeros(len(data), max(lengths), dtype=torch.long)
        mask = torch.zeros(len(data), max(lengths), dtype=torch.bool)
        for row, datum in enumerate(data):
            ids[row, : lengths[row]] = torch.as_tensor(datum.tokens)
            mask[row, : lengths[row]] = True
        targets = torch.cat([d.targets.reshape(len(d.tokens), -1) for d in data]).to(self.device)
        return self._scored(model, ids.to(self.device), mask.to(self.device), targets).reshape(-1)

    @staticmethod
    def _scored(model: nn.Module, ids: Tensor, mask: Tensor, targets: Tensor) -> Tensor:
        """`[T, K]` log-probs of `targets` (`[T, K]`) at the T positions `mask` sets: from the hidden states through
        the head's weight, chunked (`head_logprobs`), never the whole `[T, vocabulary]` logits."""
        head = model.get_output_embeddings()
        found, k = [], targets.shape[1]

        def score(hidden: Tensor) -> Tensor:
            rows, weight, bias = head_operands(head, hidden[mask].repeat_interleave(k, 0))
            found.append(head_logprobs(rows, weight, bias, targets.reshape(-1), entropy_grad=False)[0])
            return found[-1]

        with head_replaced(head, score):
            model(input_ids=ids, attention_mask=mask.long(), use_cache=False)
        return found[0].reshape(-1, k)


def head_operands(head: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """`(rows, weight, bias)` whose `rows @ weight.T + bias` are the head's logits for `hidden`: its own weight for a
    plain head; for a head with LoRA adapters active (`train_unembed`), h·Wᵀ + s·(h·Aᵀ)·Bᵀ written as one product,
    [h, s·h·Aᵀ]·[W, B]ᵀ, so that an adapted head is scored chunk by chunk too (a run's gradients reach A through the
    rows and B through the weight)."""
    if isinstance(head, nn.Linear):
        return hidden, head.weight, head.bias
    base = head.base_layer
    active = [] if head.disable_adapters else [name for name in head.active_adapters if name in head.lora_A]
    rows, weights = [hidden], [base.weight]
    for name in active:
        rows.append(head.scaling[name] * head.lora_A[name](hidden))
        weights.append(head.lora_B[name].weight)
    if len(rows) == 1:
        return hidden, base.weight, base.bias
    return torch.cat(rows, 1), torch.cat(weights, 1), base.bias


def write_adapter(directory: Path, config, tensors: dict[str, Tensor]) -> None:
    """A peft adapter directory (`PeftModel.from_pretrained` and vLLM's `LoRARequest` read it): `tensors` named as
    `SharedBase.factors` names them — peft's names in a saved adapter — and `config`, a `LoraConfig`."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({key: t.contiguous() for key, t in tensors.items()}, directory / "adapter_model.safetensors")
    saved = config.to_dict()
    saved["target_modules"] = sorted(saved["target_modules"])
    (directory / "adapter_config.json").write_text(json.dumps(saved, default=str, indent=1))


class TrainingRun:
    """One tenant's LoRA training: its adapter on the shared base, its gradients and its Adam state."""

    def __init__(self, model_id: str, base: SharedBase, shape: LoraShape):
        self.model_id, self.base, self.shape = model_id, base, shape
        self.params = base.add_adapter(model_id, shape)
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)
        self.steps = 0

    def forward(self, data: list[Datum], loss_fn: str, config: dict[str, float], *, backward: bool) -> dict:
        """Each datum's target log-probs and per-token loss under `loss_fn`, and the loss summed over tokens and data;
        with `backward`, the loss's gradients added to the adapter's (they add up until `optim_step`)."""
        function, _, defaults = LOSSES[loss_fn]
        config = {**defaults, **config}
        outputs: list[dict[str, Tensor] | None] = [None] * len(data)
        total = 0.0
        with torch.set_grad_enabled(backward):
            for batch, logp in self.base.target_logprobs(self.model_id, data):
                losses, start = [], 0
                for i in batch:
                    end = start + data[i].targets.numel()
                    inputs = {k: v.to(logp.device, logp.dtype) for k, v in data[i].inputs.items()}
                    losses.append(function(logp[start:end].reshape(data[i].targets.shape), inputs, config).reshape(-1))
                    shape = data[i].targets.shape
                    outputs[i] = {"logprobs": logp[start:end].detach().float().cpu().reshape(shape),
                                  "elementwise_loss": losses[-1].detach().float().cpu().reshape(shape)}  # fmt: skip
                    start = end
                loss = torch.cat(losses).sum()
                if backward:
                    loss.backward()
                total += float(loss.detach())
        return {"outputs": outputs, "loss": total}

    def optim_step(self, learning_rate: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:  # fmt: skip
        """One Adam step with these hyperparameters on the gradients gathered since the last, then zero them."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, grad_clip_norm if grad_clip_norm > 0 else float("inf"))
        for group in self.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm": float(norm)}

    def state(self) -> dict:
        """What resumes this run exactly: its adapter's factors and the optimizer's state (by the same names)."""
        names = list(self.base.factors(self.model_id))
        optimizer = self.optimizer.state_dict()
        per_name = {names[i]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                    for i, s in optimizer["state"].items()}  # fmt: skip
        return {"weights": self.base.adapter_tensors(self.model_id), "optimizer": per_name, "steps": self.steps}

    def load_state(self, state: dict, *, with_optimizer: bool) -> None:
        self.base.load_adapter_tensors(self.model_id, state["weights"])
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)
        if with_optimizer and state.get("optimizer"):
            names = list(self.base.factors(self.model_id))
            saved = self.optimizer.state_dict()
            saved["state"] = {i: state["optimizer"][name] for i, name in enumerate(names) if name in state["optimizer"]}
            self.optimizer.load_state_dict(saved)
            self.steps = state.get("steps", 0)

    def close(self) -> None:
        self.base.remove_adapter(self.model_id)

"""The experts a mixture routes each token to: recorded where the rollout engine samples, compared with the trainer's
choice (`rollout/route_mismatch`), and replayed in the trainer's forwards (`algorithm.routing_replay`, R3: arXiv
2510.11370).

A route is an int16 array `[tokens - 1, layers, k]`, as vLLM returns it (`enable_return_routed_experts`): row i holds
the experts of the token at position i of prompt + response, for every decoder layer (a layer without a router holds
-1, 0 from vLLM, and is never read); the last token has no row, as no forward reads it.

Why replay: the engine and the trainer compute the router's logits with other kernels, dtypes and batch shapes, and a
near tie flips a token's experts; the flips compound over the layers, and the trainer scores a token through experts
the engine never used. Replaying forces the engine's experts and recomputes their weights from the trainer's own
logits: a softmax over all experts gathered at the forced ids (never the top-k values, which are 0 for an expert the
live router did not pick, and carry no gradient), so the gradient still reaches the router and its LoRA.

The forced ids of one model call are a `Plan`, active while the call (and its recompute in the backward:
`recompute.py`) runs; hooks on the routers read it. A router a plan does not cover, or a -1 row, chooses itself.
"""

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from lorarl.trainer.errors import TrainerError


def _softmax_over_all(router: nn.Module, logits: Tensor, ids: Tensor) -> Tensor:
    """Qwen2/3-MoE, Qwen3.5-MoE, Qwen3-Next, OLMoE, Mixtral: a float32 softmax over every expert, taken at the chosen
    ids, renormalised over them where the router does (`norm_topk_prob`; always for those without the flag)."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def _softmax_over_chosen(router: nn.Module, logits: Tensor, ids: Tensor) -> Tensor:
    """gpt-oss: a softmax over the chosen experts' logits, in the logits' dtype."""
    return torch.softmax(logits.gather(-1, ids), dim=-1, dtype=logits.dtype)


# the routers replayed, by class: how each weighs the experts it chose (a router returns (logits, weights, ids))
SOFTMAX_OVER_ALL = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "Qwen3_5MoeTopKRouter", "Qwen3NextTopKRouter",
                    "OlmoeTopKRouter", "MixtralTopKRouter")  # fmt: skip
WEIGHINGS: dict[str, Callable[[nn.Module, Tensor, Tensor], Tensor]] = {
    **dict.fromkeys(SOFTMAX_OVER_ALL, _softmax_over_all),
    "GptOssTopKRouter": _softmax_over_chosen,
}


def _kind(module: nn.Module) -> str | None:
    """The router class of `module` (through a subclass FSDP made of it), if it is one replayed."""
    return next((cls.__name__ for cls in type(module).__mro__ if cls.__name__ in WEIGHINGS), None)


@dataclass
class Routers:
    """A mixture's routers, in layer order: `layers[j]` is the decoder layer of `modules[j]`."""

    modules: list[nn.Module]
    layers: list[int]
    num_layers: int  # the model's decoder layers (a route's second axis)
    experts: int
    top_k: int

    @classmethod
    def of(cls, model: nn.Module) -> "Routers | None":
        """`model`'s replayable routers (peft's or FSDP's wrappers seen through), or None where it has none."""
        found = {}
        for name, module in model.named_modules():
            layer = re.search(r"layers\.(\d+)\.", name)
            if _kind(module) is not None and layer is not None:
                found.setdefault(int(layer.group(1)), module)
        if not found:
            return None
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        first = next(iter(found.values()))
        layers = sorted(found)
        return cls([found[i] for i in layers], layers, config.num_hidden_layers, first.num_experts, first.top_k)

    def shape(self, tokens: int) -> tuple[int, int, int]:
        """The shape of a route of `tokens` tokens recorded on this model."""
        return max(tokens - 1, 0), self.num_layers, self.top_k

    def check(self, route: np.ndarray, tokens: int, where: str) -> None:
        """Refuses, in one line naming `where`, a route that cannot apply to this model and these `tokens`."""
        expected = self.shape(tokens)
        if route.shape != expected:
            raise TrainerError(f"the routes of {where} have shape {tuple(route.shape)}, expected {expected} (tokens - "
                               "1, the model's decoder layers, experts per token): recorded on another model, or cut")
        used = route[:, self.layers]
        if used.size and (used.min() < 0 or used.max() >= self.experts):
            missing = [self.layers[j] for j in range(len(self.layers)) if (used[:, j] < 0).any()]
            what = f"no experts recorded in layers {missing}" if missing else f"expert ids up to {used.max()}"
            raise TrainerError(f"the routes of {where} have {what}; the model has {self.experts} experts in layers "
                               f"{self.layers}")  # fmt: skip


def unreplayable(model: nn.Module) -> str | None:
    """Why routing replay cannot apply to `model` (None: it can)."""
    from lorarl.trainer.models import Mixture

    mixture = Mixture.of(model)
    if not mixture.experts:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
        return f"{type(base).__name__} is not a mixture of experts"
    blocks = {name.rsplit(".", 2)[0] for name in mixture.experts}  # model.layers.{i}.mlp
    routers = [model.get_submodule(name) for name in mixture.routers]
    kinds = {type(getattr(m, "base_layer", m)).__name__ for m in routers}
    if not all(any(_kind(m) for m in model.get_submodule(block).modules()) for block in blocks):
        return (f"its routers ({', '.join(sorted(kinds)) or 'none found'}) are not of a kind lorarl replays "
                f"({', '.join(WEIGHINGS)})")
    return None


@dataclass
class Plan:
    """One model call's routes: `forced` `[N, S, layers, k]` per position of the call's `[N, S]` inputs, for the
    routers in order (-1: the router's own choice); what each router chose is filled in as the call runs."""

    forced: Tensor
    replay: bool
    chosen: dict[int, Tensor] = field(default_factory=dict)  # router j -> its own choice [N * S, k]

    def __post_init__(self):
        self.forced = self.forced.long()  # the routers' own ids' dtype (routes travel narrower)

    def live(self) -> Tensor:
        """`[N, S, layers, k]`: the routers' own choices in this call."""
        return torch.stack([self.chosen[j] for j in range(self.forced.shape[2])], 1).view(self.forced.shape)

    def used(self) -> Tensor:
        """`[N, S, layers, k]`: the experts the call computed with."""
        live = self.live()
        return torch.where(self.forced >= 0, self.forced, live) if self.replay else live


_active: list[Plan | None] = [None]  # the plan of the model call running (and of its recompute)


def current() -> Plan | None:
    return _active[0]


@contextlib.contextmanager
def active(plan: Plan | None) -> Iterator[None]:
    """`plan` governs the routers for the duration (None: no plan, routers choose and nothing is recorded)."""
    before, _active[0] = _active[0], plan
    try:
        yield
    finally:
        _active[0] = before


def under(plan: Plan, forward: Callable, *args, **kwargs):
    """`forward(*args, **kwargs)` with `plan` active: a checkpointed layer's recompute routes as its forward did."""
    with active(plan):
        return forward(*args, **kwargs)


def attach(routers: Routers) -> None:
    """Hooks the routers so that the active plan's forced ids replace their choices (with `Plan.replay`), and each
    records its own choice. Without an active plan they run untouched."""
    for j, module in enumerate(routers.modules):
        module.register_forward_hook(_replayed(j, WEIGHINGS[_kind(module)]))


def _replayed(j: int, weigh: Callable):
    def hook(module: nn.Module, args, output):
        plan = _active[0]
        if plan is None:
            return None
        logits, weights, ids = output
        plan.chosen.setdefault(j, ids.detach())  # a recompute routes again: the forward's choice is kept
        if not plan.replay:
            return None
        forced = plan.forced.view(-1, *plan.forced.shape[2:])[:, j].to(ids.device)
        if forced.shape != ids.shape:
            raise TrainerError(f"routing replay: a model call routed {tuple(ids.shape)} tokens x experts, its plan "
                               f"holds {tuple(forced.shape)}")  # fmt: skip
        ids = torch.where(forced >= 0, forced, ids)
        return logits, weigh(module, logits, ids).to(weights.dtype), ids

    return hook


class Recorder:
    """Every call's choices of `routers` while `recording`: `calls[c]` is `[T, layers, k]` of the c-th model call."""

    def __init__(self, routers: Routers):
        self.routers = routers
        self.calls: list[list[Tensor]] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator["Recorder"]:
        def hook(j: int):
            def record(module, args, output) -> None:
                if j == 0:
                    self.calls.append([])
                self.calls[-1].append(output[2].detach().to("cpu", torch.int16))

            return record

        handles = [m.register_forward_hook(hook(j)) for j, m in enumerate(self.routers.modules)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def call(self, c: int) -> Tensor:
        """`[T, num_layers, k]` int16 of call `c`, -1 in the layers without a router."""
        chosen = self.calls[c]
        out = torch.full((chosen[0].shape[0], self.routers.num_layers, self.routers.top_k), -1, dtype=torch.int16)
        out[:, self.routers.layers] = torch.stack(chosen, 1)
        return out


def differing(engine: Tensor, trainer: Tensor) -> Tensor:
    """`[..., layers]` bool: where the sets of experts differ (an order within the top-k is not a difference), at the
    positions the engine recorded (no -1)."""
    same = (engine.sort(-1).values == trainer.sort(-1).values).all(-1)
    return ~same & (engine >= 0).all(-1)


def route_metrics(used: Tensor, live: Tensor, layers: list[int], old_logp: Tensor, rollout_logp: Tensor,
                  response_mask: Tensor) -> dict[str, float]:  # fmt: skip
    """The share of response tokens computed with experts other than the engine's, in any layer
    (`rollout/route_mismatch`: 0 with replay) and per layer; the share whose routers chose others themselves
    (`..._live`: the same without replay); and on those, the mean |Δ log p| between trainer and engine.
    `used`, `live`: `[N, R, layers]` bool, as `update.rerouted_tokens` gives them."""
    mask = response_mask.bool()
    tokens = float(mask.sum().clamp(min=1))
    rerouted = live.any(-1) & mask
    metrics = {"rollout/route_mismatch": float((used.any(-1) & mask).sum()) / tokens,
               "rollout/route_mismatch_live": float(rerouted.sum()) / tokens}  # fmt: skip
    for j, layer in enumerate(layers):
        metrics[f"rollout/route_mismatch/layer_{layer}"] = float((used[..., j] & mask).sum()) / tokens
    if rerouted.any():
        metrics["rollout/abs_logp_diff_rerouted"] = float((old_logp - rollout_logp).abs()[rerouted].double().mean())
    return metrics

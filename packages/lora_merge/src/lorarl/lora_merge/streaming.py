"""`iter_merged_weights`: the merged model's state dict, streamed module by module, the model left untouched.

It yields exactly the keys and values of `model.merge_and_unload().state_dict()` (base-model names, no `lora_`
tensors), but never merges in place: each LoRA layer's `W + s·B@A` is computed out of place into a fresh tensor right
before it is yielded, so the base stays bit-identical (no bf16 unmerge drift) and the extra memory is one module's
weight. (Large CPU tensors go to memory on 2 MiB pages, and once the consumer has dropped one, the next reuses its
memory, already faulted in; until the stream ends that memory stays with it: see `_output`.) Other tensors are
yielded as detached views of the model's own (no copy) unless `dtype` asks for a cast.

Mixtures of experts: peft adapts fused expert parameters (`mlp.experts.gate_up_proj` [E, 2I, H]) through
`target_parameters`, a `ParamWrapper` per parameter (nested where a module has several). Its factors are flat,
`lora_A [E·r, in]` and `lora_B [out, r·E]` with expert e's rank k in column k·E + e; read in place as `[E, r, in]`
and `[E, out, r]` views, all experts merge in one call of the grouped op (`merge_lora_grouped`), under the
parameter's own name.

FSDP2 (`torch.distributed.fsdp.fully_shard`): each sharded unit (e.g. a decoder layer) is all-gathered when the walk
enters it and freed when it leaves, so the extra memory is one unit (plus the root unit: embeddings, final norm, head)
— what lets a 70B model's merged weights stream out of a sharded trainer. The gathers are collectives: every rank of
the mesh iterates in lockstep (typically rank 0 sends what it yields, the others discard it), and yielded tensors are
copies, valid after their unit is freed again.
"""

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import NamedTuple

import torch
from torch import nn

from lorarl.lora_merge._output import OutputMemory
from lorarl.lora_merge.merge import merge_lora, merge_lora_grouped

NamedTensors = Iterator[tuple[str, torch.Tensor]]


class LoraFactors(NamedTuple):
    """What a LoRA layer adds to its base weight: `scale · lora_B @ lora_A` (transposed when `fan_in_fan_out`). For
    fused experts the factors are 3-D, `lora_A [E, r, in]` and `lora_B [E, out, r]`, one product per expert
    (`fan_in_fan_out`: the weight is stored `[E, in, out]`)."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scale: float
    fan_in_fan_out: bool


def merge_factors(
    weight: torch.Tensor, factors: LoraFactors, *, out: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """`merge_lora` of `factors` into `weight`, or `merge_lora_grouped` of experts' (out of place unless `out is
    weight`)."""
    if factors.lora_A.dim() == 3:
        return merge_lora_grouped(weight, factors.lora_A, factors.lora_B, factors.scale, out=out,
                                  transposed=factors.fan_in_fan_out, backend=backend)  # fmt: skip
    return merge_lora(weight, factors.lora_A, factors.lora_B, factors.scale, out=out,
                      fan_in_fan_out=factors.fan_in_fan_out, backend=backend)  # fmt: skip


def iter_merged_weights(
    model: nn.Module,
    *,
    adapter_name: str | None = None,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    include: Callable[[str], bool] | None = None,
) -> NamedTensors:
    """Stream `(name, tensor)` of the model with its LoRA adapter merged, in `state_dict()` order.

    `model`: a `peft.PeftModel`, a peft `LoraModel`, or a module with LoRA layers injected (a plain model without
    any also works: its state dict is streamed as is; inside peft's `disable_adapter()` the base weights are).
    `adapter_name`: merge this adapter instead of the active one(s). `dtype`: cast floating tensors to it (merged
    weights are rounded once, straight to `dtype`). `include`: yield only the names it accepts (the others are neither
    merged nor cast: an update of the layers an adapter changes, `adapted_weight_names`).
    Raises `NotImplementedError` naming the layer for DoRA and other LoRA variants, and for non-LoRA tuner layers.
    """
    merger = _Merger(model, adapter_name, dtype, backend, include=include)
    with ExitStack() as stack:  # FSDP units above the base model (e.g. the sharded PeftModel root) stay gathered
        for ancestor in _fsdp_ancestors(merger.fsdp_units, merger.base):
            stack.enter_context(_gathered(ancestor, merger))
        yield from _walk(merger.base, "", merger)


def merged_weight_specs(
    model: nn.Module,
    *,
    adapter_name: str | None = None,
    dtype: torch.dtype | None = None,
    include: Callable[[str], bool] | None = None,
) -> list[tuple[str, torch.Size, torch.dtype]]:
    """`(name, shape, dtype)` of everything `iter_merged_weights` will yield, in order, without merging anything
    (e.g. the manifest a weight transfer announces before it streams)."""
    merger = _Merger(model, adapter_name, dtype, "torch", specs_only=True, include=include)
    return [(name, t.shape, t.dtype) for name, t in _walk(merger.base, "", merger)]


def adapted_weight_names(model: nn.Module, *, adapter_name: str | None = None) -> list[str]:
    """The names `iter_merged_weights` yields that an adapter changes, in order: the weights LoRA layers adapt (and
    their biases, and a weight tied to one), and every tensor of a module trained whole (`modules_to_save`). The rest
    of the merged model is the base's, whatever the adapter learns."""
    merger = _Merger(model, adapter_name, None, "torch", specs_only=True)
    merger.adapted = []
    for _ in _walk(merger.base, "", merger):
        pass
    return merger.adapted


def lora_factors(model: nn.Module, *, adapter_name: str | None = None) -> dict[str, LoraFactors]:
    """The factors `iter_merged_weights` merges, by the name of the base weight they add to (in `state_dict()`
    order): `merge_factors(W0, factors)` is bit for bit the merged weight it yields, so an engine holding the base
    weights `W0` can rebuild the merged model from these alone (the factor sync, `r·(in+out)` values per layer).
    Tensors are detached views of the model's own. Raises `NotImplementedError` where merging needs more than
    factors: a trained bias (`lora_bias`), a module trained whole (`modules_to_save`), a sharded (FSDP) model."""
    merger = _Merger(model, adapter_name, None, "torch")
    if merger.sharded:
        raise NotImplementedError("lora_factors reads an unsharded model; gather a sharded one's adapter first")
    peft = _peft_types()
    factors = {}
    for name, module in merger.base.named_modules():
        if peft is not None and isinstance(module, peft.modules_to_save_wrapper):
            raise NotImplementedError(f"{name}: a module trained whole (modules_to_save) is not a LoRA factor")
        if peft is None or type(module) not in (peft.lora_linear, peft.lora_embedding, peft.param_wrapper):
            continue
        if any(module.lora_bias.get(a) for a in merger.adapters(name, module)):
            raise NotImplementedError(f"{name}: an adapter with lora_bias=True trains the bias, not only factors")
        layer = merger.layer_factors(name, module)
        if layer is not None:
            factors[_adapted_name(name, module, peft)] = layer
    return factors


class _Merger:
    """What to merge and how; shared by the recursive walk. With `specs_only`, tensors are shape-only (meta)."""

    def __init__(self, model: nn.Module, adapter_name: str | None, dtype: torch.dtype | None, backend: str,
                 specs_only=False, include: Callable[[str], bool] | None = None):  # fmt: skip
        self.adapter_name = adapter_name
        self.include = include  # the names to yield (None: all)
        self.adapted: list[str] | None = None  # the names an adapter changes, recorded by `adapted_weight_names`
        self.dtype = dtype
        self.backend = backend
        self.specs_only = specs_only
        self.outputs = OutputMemory()  # large merged weights reuse the memory of one the consumer has dropped
        self.base = _base_model(model)
        fsdp = _fsdp_class()
        self.fsdp_units = [m for m in model.modules() if isinstance(m, fsdp)] if fsdp is not None else []
        self.sharded = bool(self.fsdp_units)
        # id(base weight) -> (name, LoRA layer) that merges it: its tied partners get the merged value too
        self.merged_elsewhere = {
            id(layer.get_base_layer().weight): (name, layer) for name, layer in _lora_layers(self.base)
        }

    def note_adapted(self, name: str) -> None:
        if self.adapted is not None and name not in self.adapted:
            self.adapted.append(name)

    def plain(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype
        if self.specs_only:
            return torch.empty(tensor.shape, dtype=dtype, device="meta")
        if hasattr(tensor, "full_tensor"):  # a DTensor outside any FSDP unit: gather it (collective)
            return tensor.full_tensor().to(dtype)
        # a sharded model frees its gathered storage when the walk leaves the unit: hand out a copy
        return tensor.to(dtype, copy=self.sharded)

    def merged_weight(self, name: str, layer: nn.Module) -> torch.Tensor:
        """The layer's base weight with its adapter(s) merged: `W + Σ s_i · B_i @ A_i`, one rounding (for fused
        experts, `ParamWrapper`, the parameter it adapts: each expert's)."""
        weight = _adapted_tensor(layer).detach()
        factors = None if self.specs_only else self.layer_factors(name, layer)
        if factors is None:
            return self.plain(weight)
        out = self.outputs.empty(weight.shape, self.dtype or weight.dtype, weight.device)
        return merge_factors(weight, factors, out=out, backend=self.backend)

    def layer_factors(self, name: str, layer: nn.Module) -> "LoraFactors | None":
        """What `merged_weight` adds to the base weight, as one set of factors (None: nothing to add)."""
        factors = self.factors(name, layer)
        if not factors:
            return None
        if _is_experts(layer):  # peft's flat expert factors as [E, r, in] and [E, out, r] views
            experts = layer.num_experts
            factors = [(a.view(experts, -1, a.shape[-1]), b.view(b.shape[0], -1, experts).permute(2, 0, 1), s)
                       for a, b, s in factors]  # fmt: skip
            fan_in_fan_out = not layer._did_swap_in_out_features  # stored [E, in, out]: each delta transposed
        else:
            fan_in_fan_out = _is_embedding(layer) or layer.fan_in_fan_out
        if len(factors) == 1:
            lora_A, lora_B, scale = factors[0]
        else:  # several active adapters: one merge over the concatenated ranks, so still one rounding
            lora_A = torch.cat([a.to(torch.float32) for a, _, _ in factors], dim=-2)
            lora_B = torch.cat([b.to(torch.float32) * s for _, b, s in factors], dim=-1)
            scale = 1.0
        return LoraFactors(lora_A, lora_B, float(scale), bool(fan_in_fan_out))

    def merged_bias(self, name: str, layer: nn.Module) -> torch.Tensor | None:
        """`lora_bias=True` adapters shift the base bias by `s · lora_B.bias`."""
        bias = getattr(layer.get_base_layer(), "bias", None)
        if bias is None:
            return None
        shifts = [layer.lora_B[a].bias for a in self.adapters(name, layer) if layer.lora_bias.get(a)]
        if not shifts or self.specs_only:
            return self.plain(bias)
        scales = [layer.scaling[a] for a in self.adapters(name, layer) if layer.lora_bias.get(a)]
        total = bias.detach().to(torch.float32) + sum(
            s * b.detach().to(torch.float32) for s, b in zip(scales, shifts, strict=True)
        )
        return total.to(self.dtype or bias.dtype)

    def adapters(self, name: str, layer: nn.Module) -> list[str]:
        """The adapters to merge into this layer: as `merge_and_unload`, skipping those already merged in place;
        none inside peft's `disable_adapter()` context (the model then computes with its base weights alone)."""
        if layer.disable_adapters:
            return []
        wanted = [self.adapter_name] if self.adapter_name is not None else list(layer.active_adapters)
        present = layer.lora_embedding_A if _is_embedding(layer) else layer.lora_A
        chosen = [a for a in wanted if a in present and a not in layer.merged_adapters]
        for a in chosen:
            if a in layer.lora_variant:
                raise NotImplementedError(
                    f"{name or 'model'}: adapter {a!r} is a LoRA variant ({type(layer.lora_variant[a]).__name__}, "
                    "e.g. DoRA); lorarl merges plain LoRA only"
                )
        return chosen

    def factors(self, name: str, layer: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        if _is_embedding(layer):
            return [
                (layer.lora_embedding_A[a].detach(), layer.lora_embedding_B[a].detach(), layer.scaling[a])
                for a in self.adapters(name, layer)
            ]
        return [
            (layer.lora_A[a].weight.detach(), layer.lora_B[a].weight.detach(), layer.scaling[a])
            for a in self.adapters(name, layer)
        ]


def _walk(module: nn.Module, prefix: str, merger: _Merger) -> NamedTensors:
    """`module.state_dict()`'s traversal (own parameters, persistent buffers, children), with tuner layers resolved."""
    with _gathered(module, merger):
        yield from _walk_gathered(module, prefix, merger)


def _walk_gathered(module: nn.Module, prefix: str, merger: _Merger) -> NamedTensors:
    peft = _peft_types()
    if peft is not None and isinstance(module, (peft.auxiliary_wrapper, peft.tuner_layer)):
        yield from _walk_peft_layer(module, prefix, merger, peft)
        return
    yield from _own_tensors(module, prefix, merger, {})
    yield from _walk_children(module, prefix, merger)


def _walk_peft_layer(module: nn.Module, prefix: str, merger: _Merger, peft: "_PeftTypes") -> NamedTensors:
    """A module peft put in the model: what `merge_and_unload` leaves in its place, LoRA merged."""
    name = prefix.removesuffix(".")
    if isinstance(module, peft.modules_to_save_wrapper):
        for named in _walk(_module_to_save(module, merger.adapter_name), prefix, merger):
            merger.note_adapted(named[0])
            yield named
        return
    if type(module) is peft.param_wrapper:  # adapted parameters (fused experts), one wrapper each, nested
        base = module.get_base_layer()
        replaced = {}
        for layer in _wrapper_chain(module, peft):
            replaced[id(_adapted_tensor(layer))] = functools.partial(merger.merged_weight, name, layer)
        yield from _own_tensors(base, prefix, merger, replaced)
        yield from _walk_children(base, prefix, merger)
        return
    if type(module) not in (peft.lora_linear, peft.lora_embedding):
        raise NotImplementedError(
            f"{name}: {type(module).__module__}.{type(module).__qualname__} is not a plain LoRA Linear/Embedding "
            "layer, nor a LoRA on parameters (target_parameters); lorarl.lora_merge cannot merge it"
        )
    base = module.get_base_layer()
    replaced = {id(base.weight): functools.partial(merger.merged_weight, name, module)}
    bias = getattr(base, "bias", None)
    if bias is not None:
        replaced[id(bias)] = functools.partial(merger.merged_bias, name, module)
    yield from _own_tensors(base, prefix, merger, replaced)
    yield from _walk_children(base, prefix, merger)


def _walk_children(module: nn.Module, prefix: str, merger: _Merger) -> NamedTensors:
    for child_name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, f"{prefix}{child_name}.", merger)


def _own_tensors(module: nn.Module, prefix: str, merger: _Merger, replaced: dict[int, Callable]) -> NamedTensors:
    """The module's own parameters and persistent buffers: merged where `replaced` (id -> what makes the merged
    tensor) or a LoRA-merged weight's tied partner, as they are otherwise; only those `merger.include` accepts."""
    for key, param in module._parameters.items():
        if param is None:
            continue
        name = prefix + key
        if merger.include is not None and not merger.include(name):
            continue
        if id(param) in replaced:
            merger.note_adapted(name)
            yield name, replaced.pop(id(param))()
        elif id(param) in merger.merged_elsewhere:  # tied to a LoRA-merged weight: merge_and_unload changes both
            merger.note_adapted(name)
            yield name, merger.merged_weight(*merger.merged_elsewhere[id(param)])
        else:
            yield name, merger.plain(param)
    for key, buffer in module._buffers.items():
        name = prefix + key
        if buffer is None or key in module._non_persistent_buffers_set:
            continue
        if merger.include is None or merger.include(name):
            yield name, merger.plain(buffer)


class _PeftTypes(NamedTuple):
    """The peft classes the walk tells apart."""

    lora_linear: type
    lora_embedding: type
    param_wrapper: type  # LoRA on a parameter (`target_parameters`), e.g. fused experts
    tuner_layer: type  # any tuner's layer: LoRA's, LoHa's, ...
    auxiliary_wrapper: type  # modules_to_save, trainable tokens, ...
    modules_to_save_wrapper: type


@functools.cache
def _peft_types() -> _PeftTypes | None:
    """Imported once, not at every module of the walk (where the imports, with a walk for FSDP ancestors, took ~3% of
    a 0.5B model's stream); None without peft, whose absence means no LoRA layers either."""
    try:
        from peft.tuners.lora import Embedding, Linear, ParamWrapper
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
    except ImportError:
        return None
    return _PeftTypes(Linear, Embedding, ParamWrapper, BaseTunerLayer, AuxiliaryTrainingWrapper, ModulesToSaveWrapper)


@functools.cache
def _fsdp_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    return FSDPModule


@contextmanager
def _gathered(module: nn.Module, merger: _Merger):
    """An FSDP2 unit's full parameters while the walk is inside it (all-gather in, free out); others: nothing."""
    fsdp = _fsdp_class()
    if merger.specs_only or fsdp is None or not isinstance(module, fsdp):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def _fsdp_ancestors(units: list[nn.Module], base: nn.Module) -> list[nn.Module]:
    """The FSDP2 units (of the model's, in `modules()` order) that hold `base`: wrappers around it, e.g. a sharded
    `PeftModel`, outermost first."""
    return [m for m in units if m is not base and any(c is base for c in m.modules())]


def _module_to_save(wrapper: nn.Module, adapter_name: str | None) -> nn.Module:
    """The copy `merge_and_unload` keeps for a `ModulesToSaveWrapper` (an `nn.ModuleDict` has no `.get`)."""
    if adapter_name is None:
        adapter_name = wrapper.active_adapters[0] if wrapper.active_adapters else None
    if adapter_name in wrapper.modules_to_save:
        return wrapper.modules_to_save[adapter_name]
    return wrapper.original_module


def _base_model(model: nn.Module) -> nn.Module:
    """The module whose state dict `merge_and_unload()` returns (names without `base_model.model.`)."""
    try:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTuner
    except ImportError:  # no peft: no LoRA layers either
        return model
    if isinstance(model, PeftModel):
        return model.get_base_model()
    if isinstance(model, BaseTuner):
        return model.model
    return model


def _lora_layers(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    peft = _peft_types()
    if peft is None:
        return
    for name, module in root.named_modules():
        if type(module) in (peft.lora_linear, peft.lora_embedding):
            yield name, module


def _is_embedding(layer: nn.Module) -> bool:
    return isinstance(layer, _peft_types().lora_embedding)


def _is_experts(layer: nn.Module) -> bool:
    """A LoRA on a 3-D parameter: fused experts, one product per expert (a 2-D one is a plain matrix)."""
    return type(layer) is _peft_types().param_wrapper and layer._param_ndim == 3


def _adapted_tensor(layer: nn.Module) -> torch.Tensor:
    """The base tensor a LoRA layer adds to: a Linear's or Embedding's weight, or the parameter a `ParamWrapper`
    targets."""
    if type(layer) is _peft_types().param_wrapper:
        return layer.get_param()
    return layer.get_base_layer().weight


def _wrapper_chain(wrapper: nn.Module, peft: _PeftTypes) -> list[nn.Module]:
    """A `ParamWrapper` and those nested in it (one per adapted parameter of the same module), outermost first."""
    chain = [wrapper]
    while type(chain[-1].base_layer) is peft.param_wrapper:
        chain.append(chain[-1].base_layer)
    return chain


def _adapted_name(name: str, layer: nn.Module, peft: _PeftTypes) -> str:
    """The state-dict name of what a LoRA layer named `name` adapts: `<module>.weight`, or for a `ParamWrapper`
    (named `<module>` or, nested, `<module>.base_layer...`) `<module>.<parameter>`."""
    if type(layer) is not peft.param_wrapper:
        return f"{name}.weight"
    while name.endswith(".base_layer"):
        name = name.removesuffix(".base_layer")
    return f"{name}.{layer.parameter_name}"

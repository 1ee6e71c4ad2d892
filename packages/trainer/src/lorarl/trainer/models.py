"""The policy: a Hugging Face causal LM, with a peft LoRA adapter (`model.lora.rank > 0`) or fully trainable (0); and
the critic of PPO with a value model.

One copy of the base weights serves them all: the reference policy for the KL term is the model with its adapter
disabled, and the critic is a second adapter on it (`Critic`). Only full fine-tuning keeps copies: a frozen reference
(with a KL coefficient), a critic of its own.
"""

import contextlib
import copy
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from lorarl.lora_merge import cpu_has_native_bf16
from lorarl.trainer import cpu_attention, default_task
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.hub import is_hub_id, model_dir
from lorarl.trainer.schema import CriticSection, LoraSection, ModelSection

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`trainer.device`: auto (CUDA where there is one, else the CPU), cpu or cuda."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def rollout_dtype(
    name: str, training: torch.dtype, device: torch.device, *, fused_experts: bool = False
) -> torch.dtype:
    """The rollout engine's dtype (`rollout.dtype`). "auto" samples a float32 model in bfloat16 where the device
    computes it natively — as a vLLM engine serves bf16 while the trainer keeps fp32: decoding is memory-bound, and
    half the bytes decode faster (the training log-probs are recomputed in `training` anyway). Not `fused_experts` on a
    CPU (a mixture of experts in the HF engine): torch's grouped GEMM of the experts runs slower in bf16 there (a tiny
    Qwen3-MoE's rollout: 0.39 s in bf16, 0.29 s in fp32)."""
    if name != "auto":
        return DTYPES[name]
    if training != torch.float32 or (fused_experts and device.type == "cpu"):
        return training
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else training
    return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else training


def computes_natively(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `device` computes `dtype`'s matmuls with instructions of its own. A CPU without them (bf16: AVX512-BF16
    or AMX-BF16; fp16: AVX512-FP16 or AMX-FP16) runs torch's 16-bit kernels many times slower than fp32."""
    if device.type != "cpu" or dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return cpu_has_native_bf16()
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    found = capabilities() if capabilities is not None else {}
    return bool(found.get("avx512_fp16") or found.get("amx_fp16"))


def warn_slow_dtypes(chosen: dict[str, str], device: torch.device) -> None:
    """16-bit weights the device does not compute natively (`chosen`: config key -> dtype name): allowed (they halve
    the memory), but said, since the run is then many times slower than in float32."""
    slow = [
        f"{key}={name}"
        for key, name in chosen.items()
        if name in DTYPES and not computes_natively(DTYPES[name], device)
    ]
    if slow:
        warnings.warn(f"{' and '.join(slow)}: this CPU has no instructions for 16-bit matmuls (AVX512-BF16 or AMX for "
                      "bfloat16, AVX512-FP16 or AMX-FP16 for float16), so torch runs them many times slower than "
                      "float32; float32 is faster here", stacklevel=3)  # fmt: skip


def resolve_model_path(path: str, gguf_file: str | None = None, dtype: str = "float32",
                       revision: str | None = None) -> Path:  # fmt: skip
    """The Hugging Face model directory `model.path` names ('default', 'calculator': an embedded model; a Hub id: its
    snapshot in the Hugging Face cache, at `revision`) — or, with `model.gguf_file`, the directory its GGUF checkpoint
    is dequantised into (`dequantized_gguf`)."""
    if path in default_task.EMBEDDED:
        resolved = default_task.EMBEDDED[path]
    elif is_hub_id(path):
        resolved = model_dir(path, revision=revision, extra=(gguf_file,) if gguf_file else ())
    else:
        resolved = Path(path)
    if gguf_file is not None:
        return dequantized_gguf(resolved, gguf_file, dtype)
    if not (resolved / "config.json").is_file():
        raise TrainerError(f"model.path={path!r}: {resolved} is not a Hugging Face model directory (no config.json)")
    return resolved


def dequantized_gguf(directory: Path, gguf_file: str, dtype: str) -> Path:
    """A GGUF checkpoint (`directory/gguf_file`, or a path) as a plain Hugging Face model directory in `dtype`:
    dequantised by transformers (with the gguf package) once, into a cache directory keyed by the file (path, size,
    modification time) and the dtype ($LORARL_CACHE, default ~/.cache/lorarl). Everything else — the engines,
    checkpoints, export — then reads it as any model. Its tokenizer: the directory's files, else the GGUF's own."""
    import hashlib
    import os
    import uuid

    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(gguf_file) if Path(gguf_file).is_absolute() else directory / gguf_file
    if not source.is_file():
        raise TrainerError(f"model.gguf_file={gguf_file!r}: {source} not found")
    stat = source.stat()
    key = hashlib.sha1(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{dtype}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("LORARL_CACHE", Path.home() / ".cache" / "lorarl")) / "gguf" / f"{source.stem}-{key}"
    if (cache / "config.json").is_file():
        return cache
    try:
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=DTYPES[dtype])
    except ImportError as e:
        raise TrainerError(f"model.gguf_file needs the gguf package (lorarl-trainer[gguf]): {e}") from None
    model.hf_quantizer = None  # dequantised already: what blocks save_pretrained ("not serializable") is the marker
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    has_tokenizer = any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = (AutoTokenizer.from_pretrained(directory) if has_tokenizer else
                 AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name))  # fmt: skip
    partial = cache.with_name(f".{cache.name}-{uuid.uuid4().hex[:8]}")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    os.replace(partial, cache)  # complete or absent, also with several runs converting at once
    return cache


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base(path: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    cpu_attention.use_on_cpu(model, device)
    return model


class Policy:
    """The trainable model and its reference log-prob context."""

    def __init__(self, section: ModelSection, device: torch.device, *, kl_coef: float):
        self.path = resolve_model_path(section.path, section.gguf_file, section.dtype, section.revision)
        self.dtype = DTYPES[section.dtype]
        base = load_base(self.path, self.dtype, device)
        self.is_lora = _uses_lora(section.lora)
        self.frozen_reference = None
        if not self.is_lora:
            self.model = base
            if kl_coef > 0:  # a full fine-tune needs its own frozen reference for the KL term
                self.frozen_reference = copy.deepcopy(base).eval().requires_grad_(False)
        else:
            self.model = _with_adapter(base, section.lora, key="model.lora")
        self.trainable_names = [name for name, p in self.model.named_parameters() if p.requires_grad]

    def trainable(self) -> list[nn.Parameter]:
        """The policy's trainable weights (looked up by name: FSDP replaces the parameters when it shards them)."""
        return parameters_named(self.model, self.trainable_names)

    @contextlib.contextmanager
    def reference(self):
        """The module computing reference log-probs: the policy with its adapter off, or the frozen copy."""
        if self.frozen_reference is not None:
            yield self.frozen_reference
        elif self.is_lora:
            with adapters(self.model, None):
                yield self.model
        else:
            yield self.model


def _uses_lora(lora: LoraSection) -> bool:
    """An adapter is trained unless the rank is 0 (full fine-tuning) and no saved adapter is given."""
    return lora.rank > 0 or lora.adapter_path is not None


def _with_adapter(base: nn.Module, lora: LoraSection, *, key: str) -> nn.Module:
    from peft import PeftModel, get_peft_model

    if lora.adapter_path is not None:
        if not (Path(lora.adapter_path) / "adapter_config.json").is_file():
            raise TrainerError(f"model.lora.adapter_path={lora.adapter_path!r}: no adapter_config.json there")
        return PeftModel.from_pretrained(base, lora.adapter_path, is_trainable=True)
    config = lora_config(lora, base, key=key)
    asked = _targets(config)
    model = get_peft_model(base, config)
    _check_kept(config, asked, key=key)
    return model


def _targets(config) -> tuple:
    return tuple(sorted(t) if isinstance(t, (list, set)) else t
                 for t in (config.target_modules, config.target_parameters or []))  # fmt: skip


def _check_kept(config, asked: tuple, *, key: str) -> None:
    """peft renames the targets of some mixtures of experts (transformers 4's per-expert names, e.g. a `gate_proj`
    moved onto the fused experts, off a shared expert): refused, since the adapter would not be the one asked for."""
    if not isinstance(asked[0], str) and _targets(config) != asked:  # (peft expands all-linear: not a rewrite)
        raise TrainerError(f"{key}: peft rewrote the LoRA targets {asked} into {_targets(config)} (its names for "
                           "this model's experts in transformers 4); name the model's own modules")  # fmt: skip


def lora_config(lora: LoraSection, model: nn.Module, *, key: str):
    """peft's config of `lora` (the section at `key`), each target module checked against `model`: peft would
    refuse a list naming none of them, and silently skip a mistyped one beside others it finds. A mixture of experts
    gets its targets spelled out (`_mixture_config`)."""
    from peft import LoraConfig

    mixture = Mixture.of(model)
    if mixture.experts:
        return _mixture_config(lora, model, mixture, key=key)
    targets = "all-linear" if list(lora.target_modules) == ["all-linear"] else list(lora.target_modules)
    if targets != "all-linear":
        _check_targets(targets, model, key=key)
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets,
                      exclude_modules=list(lora.exclude_modules) or None, lora_dropout=lora.dropout,
                      use_rslora=lora.rslora)  # fmt: skip


class Mixture(NamedTuple):
    """The parts of a mixture-of-experts model LoRA treats apart: its fused experts (3-D parameters, one matrix per
    expert: `mlp.experts.gate_up_proj`) and its routers (the mixture block's own gates: Qwen's `mlp.gate`, a shared
    expert's `mlp.shared_expert_gate`, gpt-oss's `mlp.router`), by full name."""

    experts: list[str]  # parameter names
    routers: list[str]  # module names

    @classmethod
    def of(cls, model: nn.Module) -> "Mixture":
        experts, routers = [], []
        for name, module in model.named_modules():
            fused = [p for p, t in module.named_parameters(recurse=False) if t.dim() == 3]
            if not fused or "lora_" in name:
                continue
            name = name.replace(".base_layer", "")  # experts peft has wrapped already: by their own name
            experts += [f"{name}.{p}" for p in fused]
            block = name.rpartition(".")[0]  # the mixture block: its other children with a weight of their own
            for child, sub in model.get_submodule(block).named_children():
                sub = sub.get_base_layer() if hasattr(sub, "get_base_layer") else sub
                if f"{block}.{child}" != name and isinstance(sub._parameters.get("weight"), torch.Tensor):
                    routers.append(f"{block}.{child}")
        return cls(experts, routers)


def adapts_fused_experts(model: nn.Module) -> bool:
    """Whether `model` has a LoRA on fused experts (peft's `ParamWrapper` on a 3-D parameter)."""
    return any(type(m).__name__ == "ParamWrapper" and m.get_param().dim() == 3 for m in model.modules())


def _mixture_config(lora: LoraSection, model: nn.Module, mixture: Mixture, *, key: str):
    """LoRA on a mixture of experts, spelled out rather than left to peft's `all-linear` (which on transformers 5
    adapts Qwen3-MoE's router and Qwen2-MoE's shared-expert gate but not its experts): the linear layers (attention,
    shared experts) as modules, the fused experts as parameters (peft's `target_parameters`), the routers only with
    `train_router`. Naming `experts` in `exclude_modules` leaves the experts out; naming a router in `target_modules`
    needs `train_router`."""
    from peft import LoraConfig

    leaf = lambda name: name.rpartition(".")[2]  # noqa: E731
    routers = {leaf(name): model.get_submodule(name) for name in mixture.routers}
    expert_modules = {leaf(name.rpartition(".")[0]) for name in mixture.experts}
    excluded = set(lora.exclude_modules)
    head = model.get_output_embeddings()
    if list(lora.target_modules) == ["all-linear"]:
        modules = [name for name in _linear_layers(model) if name not in routers
                   and not any(m is head for n, m in model.named_modules() if leaf(n) == name)]  # fmt: skip
        with_experts = not expert_modules & excluded
    else:
        named = list(lora.target_modules)
        _check_targets([t for t in named if t not in expert_modules], model, key=key)
        frozen = [t for t in named if t in routers and not lora.train_router]
        if frozen:
            raise TrainerError(f"{key}.target_modules names the router {', '.join(frozen)}: a mixture's routers stay "
                               f"frozen unless {key}.train_router=true")  # fmt: skip
        modules = [t for t in named if t not in expert_modules and t not in routers]
        with_experts = bool(expert_modules & set(named)) and not expert_modules & excluded
    parameters = sorted({".".join(name.split(".")[-2:]) for name in mixture.experts}) if with_experts else []
    if lora.train_router:  # a linear router as a module; a router of its own kind (Qwen's TopKRouter) by its weight
        modules += [name for name, module in routers.items() if isinstance(module, nn.Linear)]
        parameters += [f"{name}.weight" for name, module in routers.items() if not isinstance(module, nn.Linear)]
    if with_experts and lora.dropout:
        raise TrainerError(f"{key}.dropout={lora.dropout}: peft's LoRA on fused experts (target_parameters) has no "
                           f"dropout; set it to 0, or leave the experts out "
                           f"({key}.exclude_modules=[experts])")  # fmt: skip
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=sorted(set(modules)),
                      target_parameters=parameters or None,
                      exclude_modules=sorted(excluded - expert_modules) or None, use_rslora=lora.rslora)  # fmt: skip


def _check_targets(targets: list[str], model: nn.Module, *, key: str) -> None:
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in names)]
    if missing:
        raise TrainerError(f"{key}.target_modules={targets}: the model has no module {', '.join(missing)}; its "
                           f"linear layers are {', '.join(_linear_layers(model))} (or all-linear)")  # fmt: skip


def _linear_layers(model: nn.Module) -> list[str]:
    """The names LoRA can target (the model's own linear layers; not peft's wrappers or factors)."""
    found = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":  # GPT-2's
            parts = [part for part in name.split(".") if part != "base_layer"]
            if not any(part.startswith("lora_") for part in parts):
                found.add(parts[-1])
    return sorted(found)


def parameters_named(model: nn.Module, names: list[str]) -> list[nn.Parameter]:
    """`model`'s parameters called `names` (the same names once FSDP has sharded them)."""
    wanted = set(names)
    return [p for name, p in model.named_parameters() if name in wanted]


class Critic:
    """PPO's value model: V(s_t) = a float32 linear value head on the last hidden state before token t.

    It is a LoRA adapter named "critic" beside the policy's own on the same base when both use LoRA — one copy of the
    base weights, the adapter selected per forward (`selected`) — else its own copy of the base (an adapter on it, or
    fully trained with `critic.lora.rank=0`). The policy's outputs, merged weights and saved adapter never see it."""

    ADAPTER = "critic"

    def __init__(self, section: CriticSection, policy: Policy, device: torch.device):
        self.shares_base = policy.is_lora and section.lora.rank > 0
        self.is_lora = section.lora.rank > 0
        self.adapter = self.ADAPTER if self.shares_base else "default"  # its name in `model`, if an adapter
        if self.shares_base:
            self.model = policy.model
            config = lora_config(section.lora, self.model, key="critic.lora")
            asked = _targets(config)
            self.model.add_adapter(self.ADAPTER, config)
            _check_kept(config, asked, key="critic.lora")
            self.trainable_names = [name for name, _ in self.model.named_parameters()
                                    if f".{self.ADAPTER}." in name]  # fmt: skip
        else:
            base = load_base(policy.path, policy.dtype, device)
            self.model = _with_adapter(base, section.lora, key="critic.lora") if self.is_lora else base
            self.trainable_names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        for p in parameters_named(self.model, self.trainable_names):
            p.requires_grad_(True)  # peft adds an adapter that is not the active one frozen
        config = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else None
        hidden = (config or self.model.config).hidden_size
        self.head = nn.Linear(hidden, 1, dtype=torch.float32, device=device)
        with torch.no_grad():  # values start near 0: the rewards' scale, not the hidden states' norm
            self.head.weight.normal_(0.0, 1.0 / hidden)
            self.head.bias.zero_()
        self.modules = nn.ModuleDict({"model": self.model, "head": self.head})  # names for the optimizer's state

    def trainable(self) -> list[nn.Parameter]:
        """The critic's trainable weights: its adapter (or model) and the value head."""
        return parameters_named(self.model, self.trainable_names) + list(self.head.parameters())

    def selected(self):
        """A context with the model's critic adapter active (the policy's inactive) for the duration."""
        return adapters(self.model, [self.ADAPTER]) if self.shares_base else contextlib.nullcontext(self.model)


@contextlib.contextmanager
def adapters(model: nn.Module, active: list[str] | None):
    """`model`'s LoRA layers compute with the `active` adapters (None: none — the base alone) for the duration. Not
    peft's `set_adapter`/`disable_adapter`: those flip requires_grad flags (an inactive adapter is frozen, and all are
    on disabling), which the critic's adapter beside the policy's, and the parameters of a sharded model, must keep."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper  # modules_to_save

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer | AuxiliaryTrainingWrapper)]
    before = [(m._active_adapter, m._disable_adapters) for m in layers]
    for layer in layers:
        if active is None:
            layer._disable_adapters = True
        else:
            layer._active_adapter = list(active)
    try:
        yield model
    finally:
        for layer, (names, disabled) in zip(layers, before, strict=True):
            layer._active_adapter, layer._disable_adapters = names, disabled

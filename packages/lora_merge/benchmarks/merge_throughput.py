"""Merge throughput: one JSON object per case, every ratio against baselines measured in the same run.

Per layer case (shape, rank, dtype, backend):
  seconds            median time of `merge_lora(W, A, B, s, out=out)`, `out` allocated as the library allocates the
                     outputs of merges (large CPU ones on 2 MiB pages): the memory `iter_merged_weights` reuses
  gbps               (bytes of W read + bytes of out written) / seconds
  ratio_to_copy      copy time / merge time, copy = `out.copy_(W)` on the same tensors: the memory-bandwidth bound
  ratio_to_roofline  roofline / merge time, roofline = max(copy time, 2·r·out·in / GEMM rate), the GEMM rate being
                     `torch.mm` on 2048² matrices in the dtype the kernel computes in (`gemm_dtype`: bf16 for bf16
                     factors in the C++ op on a CPU with AVX512-BF16, else fp32)
  speedup_vs_peft    peft's merge of the same layer (a real peft LoRA Linear: `get_delta_weight` + add) / merge time
  fresh_out_seconds  median time of `merge_lora(W, A, B, s)`: into a new tensor, as `iter_merged_weights` merges
  fresh_out_speedup  time of the same merge into a new `torch.empty_like(W)` / fresh_out_seconds (large CPU outputs
                     are allocated on 2 MiB pages instead of being faulted in 4 KiB at a time)
The merge, the copy, peft and the GEMM are timed in turn, repetition after repetition, so drift of a noisy machine
hits all of them alike; medians are reported.

Expert cases (a mixture of experts' fused experts: Qwen3-30B-A3B's expert shapes, 2048 hidden and 768 per expert,
with 32 of its 128 experts to fit in memory): `merge_lora_grouped` of `W [E, out, in]` against the dense merge of the
same bytes as one `[E·out, in]` matrix (`ratio_to_dense`, gbps of both), a Python loop of per-expert `merge_lora`
calls (`speedup_vs_loop`), the copy, and peft's own merge of a `ParamWrapper` (`get_delta_weight` + add).

Whole-model cases (random bf16 models: Qwen2-0.5B's shape, and four decoder layers of Llama-2-7B's): stream every
merged weight through `iter_merged_weights` vs peft's `merge_adapter()` + `unmerge_adapter()` (what peers do before
each weight sync); `ratio_to_preallocated`: the same merges into outputs allocated once / the stream's time.

    uv run python packages/lora_merge/benchmarks/merge_throughput.py [--quick]

The first line describes the run, including whether torch puts large CPU tensors on 2 MiB pages (PyTorch's
`THP_MEM_ALLOC_ENABLE=1`; with 4 KiB pages, translating addresses costs the merge a few percent on CPU).

The last line checks the issue's targets (`"case": "targets"`): on CPU the default backend at rank <= 32 reaches
0.8 of the roofline and 3x peft's speed; on a GPU Triton and the CUDA op reach 0.85 of the copy's bandwidth at
rank <= 128. It lists every case and metric below its target under "misses".
"""

import argparse
import functools
import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from lorarl.lora_merge import (
    available_backends,
    cpu_has_native_bf16,
    iter_merged_weights,
    merge_lora,
    merge_lora_grouped,
)
from lorarl.lora_merge._output import empty_output

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (8192, 8192)]
QUICK_SHAPES = [(4096, 4096), (4096, 11008)]
RANKS = [8, 32, 128]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CPU_WARMUP_SECONDS = 0.02  # each CPU timing follows this long of calls to the same function (see cpu_seconds)
# The targets. CPU: the default backend at rank <= 32 reaches this share of the roofline and is this many
# times faster than peft. GPU: Triton and the CUDA op reach this share of the copy's bandwidth at rank <= 128.
CPU_TARGET_MAX_RANK, CPU_ROOFLINE_TARGET, CPU_PEFT_SPEEDUP_TARGET = 32, 0.8, 3.0
GPU_TARGET_MAX_RANK, GPU_COPY_TARGET = 128, 0.85


def cpu_seconds(fn: Callable[[], object]) -> float:
    """Times one call of `fn` after calling it for at least CPU_WARMUP_SECONDS, so that it sees its own steady state,
    not the one another function left. One untimed call was not enough: on a 2-core Zen 4 VM a 4096² bf16 rank-8
    merge took 2.0-2.1 ms as the second call after a GEMM, peft's merge or a 64 MB read, 1.80-1.83 ms after 20 ms of
    its own (as back to back); `copy_` 1.83 ms against 1.25-1.27 ms."""
    warm_until = time.perf_counter() + CPU_WARMUP_SECONDS
    fn()
    while time.perf_counter() < warm_until:
        fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@functools.cache
def l2_flush_buffer(device: torch.device) -> torch.Tensor:
    return torch.empty(512 << 20, dtype=torch.uint8, device=device)  # 10x an H100's L2


def gpu_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Device time of one call, timed with CUDA events after the L2 cache was overwritten (a 4096² bf16 layer fits
    in an H100's 50 MB L2, so repeated calls would otherwise read W from the cache, not from memory). The flush
    also keeps the GPU busy while Python launches `fn`, so host overhead stays out of the time. The caller has made
    the first, untimed call (compilation, autotuning)."""
    l2_flush_buffer(device).zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def interleaved(
    fns: dict[str, Callable[[], object]], device: torch.device, min_seconds: float, min_reps: int
) -> dict[str, float]:
    """Median seconds of each function, timed in turn, repetition after repetition, so that slow drift of the
    machine hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    if device.type == "cuda":
        for fn in fns.values():
            fn()  # compilation, autotuning: once, not before every timed call
    started = time.perf_counter()
    while len(times[next(iter(fns))]) < min_reps or time.perf_counter() - started < min_seconds:
        for name, fn in fns.items():
            times[name].append(gpu_seconds(fn, device) if device.type == "cuda" else cpu_seconds(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


def peft_layer(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, alpha: int) -> nn.Module:
    """A real peft LoRA Linear around `weight`, with the given factors (fp32, as peft keeps adapters)."""
    from peft import LoraConfig
    from peft.tuners.lora import Linear

    base = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    base.weight = nn.Parameter(weight, requires_grad=False)
    config = LoraConfig(r=lora_A.shape[0], lora_alpha=alpha)
    layer = Linear(base, "default", r=lora_A.shape[0], lora_alpha=alpha, config=config)
    layer.lora_A["default"].weight = nn.Parameter(lora_A)
    layer.lora_B["default"].weight = nn.Parameter(lora_B)
    return layer


def peft_merge(layer: nn.Module, weight: torch.Tensor, out: torch.Tensor) -> None:
    """peft's merge of one layer, out of place: its own `get_delta_weight` (full-size fp32 temporaries), then add."""
    torch.add(weight, layer.get_delta_weight("default"), out=out)


def merge_into_empty_like(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float, backend: str
) -> torch.Tensor:
    """A merge into a new tensor from torch's allocator: the baseline of `fresh_out_speedup`."""
    return merge_lora(weight, lora_A, lora_B, scale, out=torch.empty_like(weight), backend=backend)


def layer_cases(args: argparse.Namespace, device: torch.device):
    gemm = {  # torch.mm on 2048² matrices in each dtype a kernel may compute in
        dtype: functools.partial(torch.mm, *(torch.randn(2048, 2048, device=device).to(dtype) for _ in range(2)),
                                 out=torch.empty(2048, 2048, device=device, dtype=dtype))
        for dtype in (torch.float32, torch.bfloat16)
    }  # fmt: skip
    backends = [b for b in available_backends(device) if b != "triton" or device.type == "cuda"]
    backends = [b for b in backends if args.backends is None or b in args.backends]
    shapes = QUICK_SHAPES if args.quick else SHAPES
    for shape, dtype_name, rank, factor_name in itertools.product(shapes, DTYPES, RANKS, args.factor_dtypes):
        if factor_name != "fp32" and shape != shapes[0]:
            continue  # the other factor dtypes on the first shape only (the run's length)
        dtype, factor_dtype = DTYPES[dtype_name], DTYPES[factor_name]
        weight = torch.randn(shape, device=device).to(dtype)
        out = empty_output(weight.shape, weight.dtype, weight.device)
        lora_A = (torch.randn(rank, shape[1], device=device) / rank**0.5).to(factor_dtype)
        lora_B = (torch.randn(shape[0], rank, device=device) * 0.01).to(factor_dtype)
        alpha = 2 * rank
        scale = alpha / rank
        with torch.no_grad():
            layer = peft_layer(weight, lora_A, lora_B, alpha)
        for backend in backends:
            if factor_name != "fp32" and backend == "torch":
                continue  # other factor dtypes: the compiled kernels only
            gemm_dtype = computes_in(backend, device, factor_dtype, rank)
            fns = {
                "merge": functools.partial(merge_lora, weight, lora_A, lora_B, scale, out=out, backend=backend),
                "copy": functools.partial(out.copy_, weight),
                "peft": functools.partial(peft_merge, layer, weight, out),
                "fresh": functools.partial(merge_lora, weight, lora_A, lora_B, scale, backend=backend),
                "fresh_torch": functools.partial(merge_into_empty_like, weight, lora_A, lora_B, scale, backend),
                "gemm": gemm[gemm_dtype],
            }
            with torch.no_grad():
                t = interleaved(fns, device, args.min_seconds, args.min_reps)
            gemm_rate = 2 * 2048**3 / t["gemm"]
            roofline = max(t["copy"], 2 * rank * shape[0] * shape[1] / gemm_rate)
            moved = weight.numel() * (weight.element_size() + out.element_size())
            yield {
                "case": "layer",
                "backend": backend,
                "shape": list(shape),
                "rank": rank,
                "dtype": dtype_name,
                "factor_dtype": factor_name,
                "seconds": t["merge"],
                "gbps": moved / t["merge"] / 1e9,
                "ratio_to_copy": t["copy"] / t["merge"],
                "ratio_to_roofline": roofline / t["merge"],
                "speedup_vs_peft": t["peft"] / t["merge"],
                "fresh_out_seconds": t["fresh"],
                "fresh_out_speedup": t["fresh_torch"] / t["fresh"],
                "copy_seconds": t["copy"],
                "peft_seconds": t["peft"],
                "gemm_dtype": str(gemm_dtype).removeprefix("torch."),
                "gemm_gflops": gemm_rate / 1e9,
            }


EXPERT_SHAPES = {"gate_up_proj": (1536, 2048), "down_proj": (2048, 768)}  # Qwen3-30B-A3B's, per expert
EXPERTS = 32  # of its 128: 200 MB of bf16 gate_up_proj, 100 MB of down_proj
GROUPED_TARGET = 0.8  # the issue's: the grouped merge reaches this share of the dense merge's GB/s


def expert_cases(args: argparse.Namespace, device: torch.device):
    backends = [b for b in available_backends(device) if b != "triton" or device.type == "cuda"]
    backends = [b for b in backends if args.backends is None or b in args.backends]
    for (name, (rows, cols)), rank in itertools.product(EXPERT_SHAPES.items(), (8, 32)):
        weight = torch.randn(EXPERTS, rows, cols, device=device).to(torch.bfloat16)
        flat_A = torch.randn(EXPERTS * rank, cols, device=device) / rank**0.5  # peft's flat layout, fp32
        flat_B = torch.randn(rows, rank * EXPERTS, device=device) * 0.01
        lora_A = flat_A.view(EXPERTS, rank, cols)
        lora_B = flat_B.view(rows, rank, EXPERTS).permute(2, 0, 1)
        dense_A, dense_B = lora_A[0], torch.randn(EXPERTS * rows, rank, device=device) * 0.01
        dense = weight.view(EXPERTS * rows, cols)
        out = empty_output(weight.shape, weight.dtype, weight.device)
        with torch.no_grad():
            wrapper = peft_experts(weight, flat_A, flat_B, rank)
        for backend in backends:
            fns = {
                "grouped": functools.partial(merge_lora_grouped, weight, lora_A, lora_B, 2.0, out=out,
                                             backend=backend),
                "dense": functools.partial(merge_lora, dense, dense_A, dense_B, 2.0, out=out.view_as(dense),
                                           backend=backend),
                "loop": functools.partial(merge_each_expert, weight, lora_A, lora_B, out, backend),
                "copy": functools.partial(out.copy_, weight),
                "peft": functools.partial(peft_experts_merge, wrapper, weight, out),
            }  # fmt: skip
            with torch.no_grad():
                t = interleaved(fns, device, args.min_seconds, args.min_reps)
            moved = weight.numel() * 2 * weight.element_size()
            yield {
                "case": "experts",
                "backend": backend,
                "parameter": name,
                "shape": [EXPERTS, rows, cols],
                "rank": rank,
                "dtype": "bf16",
                "factor_dtype": "fp32",
                "seconds": t["grouped"],
                "gbps": moved / t["grouped"] / 1e9,
                "dense_gbps": moved / t["dense"] / 1e9,
                "ratio_to_dense": t["dense"] / t["grouped"],
                "speedup_vs_loop": t["loop"] / t["grouped"],
                "ratio_to_copy": t["copy"] / t["grouped"],
                "speedup_vs_peft": t["peft"] / t["grouped"],
            }


def merge_each_expert(weight, lora_A, lora_B, out, backend: str) -> None:
    """What a merge without a grouped op does: one call per expert, from Python."""
    for e in range(weight.shape[0]):
        merge_lora(weight[e], lora_A[e], lora_B[e], 2.0, out=out[e], backend=backend)


def peft_experts(weight: torch.Tensor, flat_A: torch.Tensor, flat_B: torch.Tensor, rank: int) -> nn.Module:
    """A real peft `ParamWrapper` on a module holding `weight` as fused experts, with the given flat factors."""
    from peft import LoraConfig, get_peft_model

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(weight, requires_grad=False)

    model = get_peft_model(nn.Sequential(Experts()), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[],
                                                                target_parameters=["0.weight"]))  # fmt: skip
    wrapper = model.base_model.model[0]
    wrapper.lora_A["default"].weight = nn.Parameter(flat_A)
    wrapper.lora_B["default"].weight = nn.Parameter(flat_B)
    return wrapper


def peft_experts_merge(wrapper: nn.Module, weight: torch.Tensor, out: torch.Tensor) -> None:
    torch.add(weight, wrapper.get_delta_weight("default"), out=out)


def computes_in(backend: str, device: torch.device, factor_dtype: torch.dtype, rank: int) -> torch.dtype:
    """The dtype of the kernel's multiply-adds: bf16 pairs for bf16 factors of an even rank in the C++ op on a CPU
    with AVX512-BF16, fp32 otherwise."""
    bf16_pairs = backend == "cpp" and device.type == "cpu" and factor_dtype == torch.bfloat16 and rank % 2 == 0
    return torch.bfloat16 if bf16_pairs and cpu_has_native_bf16() else torch.float32


def target_misses(cases: list[dict], device_type: str, cpu_default_backend: str) -> tuple[int, list[dict]]:
    """How many layer cases the targets apply to, and each (case, metric) below its target, so that a run's last
    line says whether the targets hold instead of leaving it to a reader of the table."""
    if device_type == "cuda":
        checks = [("ratio_to_copy", GPU_COPY_TARGET)]
        applies = [c for c in cases if c["backend"] in ("triton", "cpp") and c["rank"] <= GPU_TARGET_MAX_RANK]
    else:
        checks = [("ratio_to_roofline", CPU_ROOFLINE_TARGET), ("speedup_vs_peft", CPU_PEFT_SPEEDUP_TARGET)]
        applies = [c for c in cases if c["backend"] == cpu_default_backend and c["rank"] <= CPU_TARGET_MAX_RANK]
    misses = [
        {k: case[k] for k in ("backend", "shape", "rank", "dtype")}
        | {"metric": metric, "value": case[metric], "target": target}
        for case in applies
        for metric, target in checks
        if case[metric] < target
    ]
    return len(applies), misses


def random_bf16_model(config, device: torch.device) -> nn.Module:
    """A random bf16 causal LM of `config`'s shape, built without HF's slow weight init."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device=device).to(torch.bfloat16)
    model.tie_weights()  # to_empty gave a tied lm_head a storage of its own
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def whole_models() -> dict[str, object]:
    """The whole-model cases: Qwen2.5-0.5B's shape (494M parameters, every layer under 32 MiB), and four decoder layers
    of Llama-2-7B's shape (1.1B parameters; 32-86 MiB layers, which merges write to memory on 2 MiB pages, reused)."""
    from transformers import LlamaConfig, Qwen2Config

    return {
        "qwen2-0.5b-shaped": Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, tie_word_embeddings=True,
        ),
        "llama-7b-shaped-4-layers": LlamaConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=4, num_attention_heads=32,
            num_key_value_heads=32,
        ),
    }  # fmt: skip


def model_case(args: argparse.Namespace, device: torch.device, name: str, config: object, rank: int = 32):
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    model = get_peft_model(
        random_bf16_model(config, device),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False),
    )
    parameters = sum(p.numel() for p in model.get_base_model().parameters() if not p.requires_grad)
    lora_layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    outs = [torch.empty_like(m.get_base_layer().weight) for m in lora_layers]

    def stream() -> None:
        for _ in iter_merged_weights(model):
            pass

    def merge_into_preallocated() -> None:  # the same merges, into outputs allocated once: the floor of a stream
        for m, out in zip(lora_layers, outs, strict=True):
            lora_A, lora_B = m.lora_A["default"].weight, m.lora_B["default"].weight
            merge_lora(m.get_base_layer().weight, lora_A, lora_B, m.scaling["default"], out=out)

    def peft_merge_unmerge() -> None:
        model.merge_adapter()
        model.unmerge_adapter()

    fns = {"stream": stream, "preallocated": merge_into_preallocated, "peft": peft_merge_unmerge}
    with torch.no_grad():
        t = interleaved(fns, device, args.min_seconds, min(args.min_reps, 3))
    yield {
        "case": "model",
        "model": name,
        "parameters": parameters,
        "rank": rank,
        "dtype": "bf16",
        "target_modules": "all-linear",
        "seconds": t["stream"],
        "peft_seconds": t["peft"],
        "speedup_vs_peft": t["peft"] / t["stream"],
        "ratio_to_preallocated": t["preallocated"] / t["stream"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (under 5 minutes on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-model", action="store_true", help="skip the whole-model case")
    parser.add_argument(
        "--factor-dtypes",
        nargs="+",
        choices=DTYPES,
        default=list(DTYPES),
        help="dtypes of lora_A/lora_B (peft keeps them in fp32; others: on the first shape, compiled kernels only)",
    )
    parser.add_argument("--backends", nargs="+", help="only these backends (default: every available one)")
    parser.add_argument("--experts-only", action="store_true", help="only the expert cases (a mixture of experts)")
    args = parser.parse_args()
    args.min_seconds, args.min_reps = (0.3, 5) if args.quick else (1.0, 11)
    device = torch.device(args.device)
    processor = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    )
    run = {
        "processor": processor,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "huge_page_allocations": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
    }
    print(json.dumps(run), flush=True)
    cases = []
    for case in [] if args.experts_only else layer_cases(args, device):
        print_case(case)
        cases.append(case)
    experts = []
    for case in expert_cases(args, device):
        print_case(case)
        experts.append(case)
    grouped_misses = [{k: c[k] for k in ("backend", "parameter", "rank", "ratio_to_dense")} for c in experts
                      if c["ratio_to_dense"] < GROUPED_TARGET]  # fmt: skip
    print_case({"case": "grouped_target", "target": GROUPED_TARGET, "met": not grouped_misses,
                "misses": grouped_misses})  # fmt: skip
    if not args.no_model and not args.experts_only:
        for name, config in whole_models().items():
            for case in model_case(args, device, name, config):
                print_case(case)
    # what `backend="auto"` runs on CPU (asked of this run's device: a GPU run holds the op built with CUDA)
    cpu_default_backend = "cpp" if "cpp" in available_backends(device) else "torch"
    checked, misses = target_misses(cases, device.type, cpu_default_backend)
    if checked:
        print_case({"case": "targets", "device": device.type, "checked": checked, "met": not misses, "misses": misses})


def print_case(case: dict) -> None:
    """One JSON line; floats to 4 significant digits (GPU times are microseconds: fixed decimals would zero them)."""
    print(json.dumps(rounded(case)), flush=True)


def rounded(value: object) -> object:
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


if __name__ == "__main__":
    main()

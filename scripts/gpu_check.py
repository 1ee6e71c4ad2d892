"""One command that checks every path lorarl can run on a single NVIDIA GPU, written for the GPU machines this project
is lent: their own `python3` with torch, transformers, peft, triton, accelerate, safetensors, ninja and nvcc, and
nothing else (no uv, no package registry, no vLLM). From the root of a checkout:

    PYTHONPATH=packages/lora_merge/src:packages/padding/src:packages/weight_sync/src:packages/trainer/src \\
        python3 scripts/gpu_check.py --out gpu-check

The trainer's pure-Python dependencies such a machine lacks are packed beforehand, where they are installed, by
`uv run python scripts/gpu_check.py --pack-vendor` into `gpu-vendor/` (git-ignored: carried beside the checkout);
the checks find them there.

Each check runs in a process of its own under a time limit, so one that fails, hangs or crashes the GPU does not
hide the others; together they fit `--budget` seconds (default 540), and checks that no longer fit are listed as not
run (`--only NAME,...` runs them in a second call). Written to `--out`: `gpu_check.json` (the environment and each
check's status, seconds and figures), `gpu_check.md` (the same as a table, also printed), and the raw output of the
checks that have some. The exit code is 1 when a check failed.

The checks, in the order they run:
  environment      GPU, driver, CUDA, and the versions of torch, triton, transformers, peft, nvcc
  merge_kernels    every merge backend (Triton and the C++/CUDA op JIT-built with nvcc/ninja on a GPU) for bf16, fp16
                   and fp32 weights x bf16 and fp32 factors, against a float64 reference (one rounding) and peft
  streaming        `iter_merged_weights` of a Qwen2-0.5B-shaped bf16 model vs peft's `merge_and_unload`
  ipc_mailbox      the bucket mailbox between a producer and two consumer processes (CUDA IPC on a GPU): two
                   versions bit-identical, and a killed consumer makes the producer raise within its timeout
  hf_engine        the HF rollout engine, in the trainer's process and in one of its own, fed merged weights or the
                   LoRA factors (merged by the engine with the trainer's kernel): after a step its weights equal the
                   trainer's merge bit for bit; the adapter it serves generates what the merge generates
  trainer_default  `uv run trainer`'s job without uv (`python3 -m lorarl.trainer.cli`): validation accuracy must rise
  trainer_smollm2  a random SmolLM2-135M-shaped model in bf16 with gradient checkpointing, 20 steps on a reward it can
                   learn: the reward must rise
  fsdp_one_rank    the data-parallel code path under torchrun with one rank (FSDP2 over NCCL on a GPU): two steps,
                   and the engine holds the merge of the sharded model bit for bit
  merge_throughput `packages/lora_merge/benchmarks/merge_throughput.py --quick` on the device (its JSON lines kept):
                   every layer case, and whole models streamed against peft's merge + unmerge
  step_vs_trl      `benchmarks/step_vs_trl.py --quick` on the device, if TRL and `datasets` import; skipped if not

`--device cpu` runs the same checks on the CPU (Triton left out; shared memory stands in for CUDA IPC); `--smoke`
shrinks every model and run (the test suite runs `--device cpu --smoke`, so the script cannot rot between GPU
sessions).
"""

import argparse
import dataclasses
import importlib.metadata
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "packages" / name / "src" for name in ("lora_merge", "padding", "weight_sync", "trainer")]
# The trainer's pure-Python dependencies a bare GPU machine lacks (its binary ones it has: numpy, PyYAML, tokenizers;
# matplotlib, for plots only, is optional): `--pack-vendor` copies them into `--vendor` from this environment, and
# the checks import them from there (after the packages' sources on PYTHONPATH).
VENDORED = ("omegaconf", "rich", "markdown-it-py", "mdurl", "pygments")
DEFAULT_BUDGET_S = 540.0  # a device call may last 10 minutes; the rest is the machine's start and the transfers


class Skip(Exception):
    """A check that does not apply here (no CUDA, a missing optional package, --smoke): why, in its message."""


@dataclass(frozen=True)
class Context:
    device: str  # "cuda" or "cpu"
    smoke: bool
    out: Path


# --- the checks (each runs in a process of its own; returns its figures, raises Skip or fails) ---------------------


def environment(ctx: Context) -> dict:
    import platform

    import torch

    figures = {"python": platform.python_version(), "torch": torch.__version__, "cuda_available":
               torch.cuda.is_available(), "torch_cuda": torch.version.cuda, "cpus": os.cpu_count()}  # fmt: skip
    for name in ("triton", "transformers", "peft", "accelerate", "safetensors", "ninja", "trl", "datasets", "vllm"):
        try:
            figures[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            figures[name] = "not installed"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        figures.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 1e9, 1),
                       compute_capability=f"{props.major}.{props.minor}")  # fmt: skip
    for key, command in (("driver", ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
                         ("nvcc", ["nvcc", "--version"])):  # fmt: skip
        try:
            figures[key] = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()
            figures[key] = figures[key].splitlines()[-1] if figures[key] else "no output"
        except OSError:
            figures[key] = "not found"
    return figures


def merge_kernels(ctx: Context) -> dict:
    import torch
    from merge_reference import assert_merged_close, magnitude, merged_float64, ulp
    from merge_throughput import peft_layer

    from lorarl.lora_merge import available_backends, merge_lora

    device = torch.device(ctx.device)
    started = time.perf_counter()
    backends = [b for b in available_backends(device) if b != "triton" or device.type == "cuda"]
    build_s = round(time.perf_counter() - started, 1)  # the C++ (and CUDA) op's JIT build, or loading its cache
    shapes = [(130, 257)] if ctx.smoke else [(130, 257), (1024, 4096)]
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    # the largest error of lorarl's merge and of peft's against float64: in ulps of the result for 16-bit weights;
    # for fp32 relative to the terms' size |W| + |s|·|B||A| (they may cancel to a result far below an ulp of them)
    figures: dict = {"backends": backends, "cpp_build_s": build_s, "first_call_s": {}, "cases": 0, "worst_error": {}}
    failures = []
    generator = torch.Generator().manual_seed(0)
    for backend in backends:
        for shape in shapes:
            for w_name, w_dtype in dtypes.items():
                for f_name in ("bf16", "fp32"):
                    rank = 16
                    weight = torch.randn(shape, generator=generator).to(w_dtype)
                    lora_A = (torch.randn(rank, shape[1], generator=generator) / rank**0.5).to(dtypes[f_name])
                    lora_B = (torch.randn(shape[0], rank, generator=generator) * 0.1).to(dtypes[f_name])
                    on_device = [t.to(device) for t in (weight, lora_A, lora_B)]
                    started = time.perf_counter()
                    got = merge_lora(*on_device, 2.0, backend=backend).cpu()
                    if backend not in figures["first_call_s"]:  # Triton compiles (and autotunes) on its first call
                        figures["first_call_s"][backend] = round(time.perf_counter() - started, 2)
                    figures["cases"] += 1
                    case = f"{backend} {shape[0]}x{shape[1]} W {w_name} factors {f_name}"
                    try:
                        assert_merged_close(got, weight, lora_A, lora_B, 2.0)
                    except AssertionError as e:
                        failures.append(f"{case}: {e}")
                    with torch.no_grad():  # peft's merge of the same layer (fp32 factors, as peft keeps them)
                        layer = peft_layer(weight, lora_A.float(), lora_B.float(), alpha=2 * rank)
                        peft = (weight + layer.get_delta_weight("default")).to(w_dtype)
                    exact = merged_float64(weight, lora_A, lora_B, 2.0)
                    if w_dtype == torch.float32:
                        unit, key = magnitude(weight, lora_A, lora_B, 2.0), f"W {w_name} (relative)"
                    else:
                        unit, key = ulp(exact.to(w_dtype).double(), w_dtype), f"W {w_name} (ulps)"
                    worst = figures["worst_error"].setdefault(key, {"lorarl": 0.0, "peft": 0.0})
                    for who, merged in (("lorarl", got), ("peft", peft)):
                        error = ((merged.double() - exact).abs() / unit).max().item()
                        worst[who] = float(f"{max(worst[who], error):.3g}")
    if failures:
        raise AssertionError(f"{len(failures)} of {figures['cases']} cases off the float64 reference:\n" +
                             "\n".join(failures))  # fmt: skip
    return figures


def streaming(ctx: Context) -> dict:
    import copy

    import torch
    from merge_reference import assert_merged_close, magnitude, merged_float64, ulp
    from merge_throughput import random_bf16_model, whole_models
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import Qwen2Config

    from lorarl.lora_merge import iter_merged_weights

    if ctx.smoke:
        config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)  # fmt: skip
    else:
        config = whole_models()["qwen2-0.5b-shaped"]
    torch.manual_seed(0)
    base = random_bf16_model(config, torch.device(ctx.device))
    model = get_peft_model(base, LoraConfig(r=32, lora_alpha=64, target_modules="all-linear", init_lora_weights=False))
    layers = {name.removeprefix("base_model.model.") + ".weight": m for name, m in model.named_modules()
              if isinstance(m, LoraLinear)}  # fmt: skip
    with torch.no_grad():
        merged = {name: t.clone() for name, t in iter_merged_weights(model)}
        reference = copy.deepcopy(model).merge_and_unload().state_dict()
    if list(merged) != list(reference):
        raise AssertionError(f"names differ from merge_and_unload's: {sorted(set(merged) ^ set(reference))[:5]}")
    differing, elements = 0, 0  # elements where lorarl's merge and peft's differ
    for name, tensor in merged.items():
        if name in layers:
            m = layers[name]
            weight, lora_A, lora_B = m.get_base_layer().weight, m.lora_A["default"].weight, m.lora_B["default"].weight
            assert_merged_close(tensor, weight, lora_A, lora_B, m.scaling["default"])  # one rounding of W + s·B@A
            spacing = ulp(reference[name].cpu().double(), torch.bfloat16)
            ulps_from_peft = (tensor.cpu().double() - reference[name].cpu().double()).abs() / spacing
            differing, elements = differing + int((ulps_from_peft > 0).sum()), elements + tensor.numel()
            if ctx.device == "cpu" and not (ulps_from_peft <= 1).all():  # peft merges 16-bit layers in fp32 on CPU
                raise AssertionError(f"{name}: more than an ulp from merge_and_unload")
            # on a GPU peft rounds s·B@A to bf16 before adding it to W (two roundings): lorarl is no further from
            # the float64 merge than peft anywhere, but for its fp32 accumulation ((r + 2) fp32 epsilons of the terms)
            terms = (weight.cpu(), lora_A.cpu(), lora_B.cpu(), m.scaling["default"])
            exact = merged_float64(*terms)
            slack = (lora_A.shape[0] + 2) * torch.finfo(torch.float32).eps * magnitude(*terms)
            ours, peft = ((t.cpu().double() - exact).abs() for t in (tensor, reference[name]))
            if not (ours <= peft + slack).all():
                raise AssertionError(f"{name}: further from the float64 merge than merge_and_unload")
        elif not torch.equal(tensor, reference[name]):
            raise AssertionError(f"{name}: not LoRA-merged, yet differs from merge_and_unload")
    # (its speed against peft's merge + unmerge: merge_throughput's whole-model cases)
    return {"tensors": len(merged), "lora_layers": len(layers), "bytes": sum(t.nbytes for t in merged.values()),
            "share_differing_from_peft": round(differing / max(elements, 1), 6)}  # fmt: skip


def ipc_mailbox(ctx: Context) -> dict:
    from functools import partial

    import shared_workers as s
    from sync_processes import run_group
    from sync_workers import mixed_tensors

    workers = [partial(s.producer, device=ctx.device)] + [partial(s.consumer, device=ctx.device)] * 2
    outcome = run_group(workers, join=False, deadline=120)
    for rank, (status, value) in outcome.items():
        if status != "ok":
            raise AssertionError(f"rank {rank} {status}: {value}")
    for rank in (1, 2):
        s.check_two_transfers(outcome[rank][1])
    killed = [partial(s.producer, timeout=3, device=ctx.device), partial(s.dying_consumer, device=ctx.device),
              partial(s.consumer, device=ctx.device)]  # fmt: skip
    outcome = run_group(killed, join=False, deadline=60)  # the producer must raise at its own 3 s timeout
    if outcome[0][0] != "error" or "did not finish within 3 s" not in outcome[0][1]:
        raise AssertionError(f"a killed consumer: the producer gave {outcome[0]}")
    return {"consumers": 2, "versions": 2, "tensors": len(mixed_tensors()),
            "killed_consumer": "the producer raised at its 3 s timeout"}  # fmt: skip


def hf_engine(ctx: Context) -> dict:
    from trainer_fixtures import assert_same_completions, greedy_after_sync, make_adapter_nonzero

    from lorarl.lora_merge import iter_merged_weights
    from lorarl.trainer.engines.hf import checksum

    figures = {}
    placements = itertools.product(("inline", "process"), ("merged", "factors"))
    if ctx.smoke:  # each placement and each sync once: the code the full product runs
        placements = [("inline", "merged"), ("process", "factors")]
    for worker, sync in placements:
        # factors: the engine merges them with the trainer's kernel (Triton on a GPU) from its base copy
        trainer = default_trainer(ctx, f"hf-{sync}", rollout__worker=worker, rollout__sync=sync)
        trainer.start_engine()
        try:
            trainer.weights.sync()
            metrics = trainer.train_step(1)
            merged = checksum(iter_merged_weights(trainer.model, dtype=trainer.rollout_dtype))
            if trainer.engine.checksum() != merged:
                raise AssertionError(f"{worker} engine, {sync} sync: its weights are not the trainer's merge after a "
                                     "step")  # fmt: skip
            figures[f"{worker}_{sync}_step_s"] = round(metrics["timing/step_s"], 3)
            figures[f"{worker}_{sync}_sync_bytes"] = metrics["sync/bytes"]
            figures[f"{worker}_rollout_dtype"] = str(trainer.rollout_dtype).removeprefix("torch.")
        finally:
            trainer.engine.close()
    # the adapter served unmerged against the same weights merged, in float32 (bf16 rounds the two differently)
    trainer = default_trainer(ctx, "hf-adapter", rollout__sync="adapter", rollout__dtype="float32",
                              rollout__worker="process")  # fmt: skip
    trainer.start_engine()
    try:
        make_adapter_nonzero(trainer.model)
        prompts = [e.prompt_ids for e in trainer.rollouts.examples[:8]]
        served = greedy_after_sync(trainer, prompts, version=2, kind="adapter")
        merged = greedy_after_sync(trainer, prompts, version=2, kind="merged")
    finally:
        trainer.engine.close()
    assert_same_completions(served, merged)
    figures["adapter_matches_merged_prompts"] = len(prompts)
    return figures


def trainer_default(ctx: Context) -> dict:
    steps = ["trainer.steps=6", "trainer.eval_every=3"] if ctx.smoke else []
    run = run_trainer(ctx, "trainer-default", [f"trainer.device={ctx.device}", *steps])
    accuracy = [r["val/accuracy"] for r in run if "val/accuracy" in r]
    figures = run_figures(run) | {"val_accuracy_first": accuracy[0], "val_accuracy_last": accuracy[-1]}
    if not ctx.smoke and accuracy[-1] <= accuracy[0]:
        raise AssertionError(f"validation accuracy did not rise: {accuracy[0]:.3f} -> {accuracy[-1]:.3f}")
    return figures


def trainer_smollm2(ctx: Context) -> dict:
    from step_vs_trl import CASES, make_model

    shape = dict(CASES["smollm2-135m-shaped"].model)
    if ctx.smoke:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)  # fmt: skip
    model = make_model(dataclasses.replace(CASES["smollm2-135m-shaped"], model=shape), ctx.out / "models")
    plant_even_token_direction(model)
    steps = 3 if ctx.smoke else 20
    run = run_trainer(ctx, "trainer-smollm2", [
        f"model.path={model}", "model.dtype=bfloat16", f"trainer.device={ctx.device}", f"trainer.steps={steps}",
        "trainer.eval_every=0", f"reward.fn={Path(__file__).resolve()}:even_token_share", "data.batch_size=8",
        "rollout.n=8", "rollout.max_tokens=16", "actor.lr=1e-3", "actor.gradient_checkpointing=true",
        "algorithm.kl_coef=0"])  # fmt: skip
    rewards = [r["reward/mean"] for r in run]
    first, last = sum(rewards[:5]) / len(rewards[:5]), sum(rewards[-5:]) / len(rewards[-5:])
    figures = run_figures(run) | {"reward_first_5": first, "reward_last_5": last}
    if not ctx.smoke and last <= first + 0.05:
        raise AssertionError(f"the reward did not rise: {first:.3f} -> {last:.3f} (mean of the first and last 5)")
    return figures


def fsdp_one_rank(ctx: Context) -> dict:
    result = ctx.out / "fsdp_one_rank.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", __file__,
               "--fsdp-rank", "--device", ctx.device, "--out", str(ctx.out), "--result", str(result)]  # fmt: skip
    run_child(ctx, "fsdp_one_rank", command, what="torchrun")
    outcome = json.loads(result.read_text())
    if outcome["status"] != "ok":
        raise AssertionError(f"the rank: {outcome.get('error')}")
    return outcome["figures"]


def fsdp_rank(ctx: Context) -> dict:
    """The torchrun rank of `fsdp_one_rank`: the trainer's data-parallel path with a world of one."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lorarl.lora_merge import iter_merged_weights
    from lorarl.trainer.engines.hf import checksum

    trainer = default_trainer(ctx, "fsdp")
    if trainer.dp is None or dist.get_world_size() != 1:
        raise AssertionError("torchrun with one rank did not take the data-parallel path")
    backend = dist.get_backend()
    sharded = sum(isinstance(p, DTensor) for p in trainer.model.parameters())
    if not sharded:
        raise AssertionError("no parameter is an FSDP2 DTensor")
    trainer.start_engine()
    try:
        trainer.weights.sync()
        seconds = [trainer.train_step(step)["timing/step_s"] for step in (1, 2)]
        if trainer.engine.checksum() != checksum(iter_merged_weights(trainer.model, dtype=trainer.rollout_dtype)):
            raise AssertionError("the engine does not hold the merge of the sharded model")
    finally:
        trainer.engine.close()
    dist.destroy_process_group()
    return {"process_group": backend, "sharded_parameters": sharded, "step_s": [round(s, 3) for s in seconds]}


def merge_throughput(ctx: Context) -> dict:
    if ctx.smoke:
        raise Skip("--smoke: the benchmark has tests of its own")
    script = ROOT / "packages" / "lora_merge" / "benchmarks" / "merge_throughput.py"
    lines = run_script(ctx, "merge_throughput", [script, "--quick", "--device", ctx.device])
    layers = [c for c in lines if c.get("case") == "layer"]
    by_backend = {}
    for backend in sorted({c["backend"] for c in layers}):
        ratios = sorted(c["ratio_to_copy"] for c in layers if c["backend"] == backend and c["rank"] <= 128)
        by_backend[backend] = {"min_ratio_to_copy": ratios[0], "median_ratio_to_copy": ratios[len(ratios) // 2]}
    models = {c["model"]: {"stream_s": c["seconds"], "speedup_vs_peft": c["speedup_vs_peft"]}
              for c in lines if c.get("case") == "model"}  # fmt: skip
    targets = next((c for c in lines if c.get("case") == "targets"), {})
    return {"ratio_to_copy_rank_le_128": by_backend, "models": models, "targets_met": targets.get("met"),
            "misses": targets.get("misses")}  # fmt: skip


def step_vs_trl(ctx: Context) -> dict:
    if ctx.smoke:
        raise Skip("--smoke: a benchmark of whole runs")
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        raise Skip(f"TRL cannot run here: {e}") from None
    script = ROOT / "benchmarks" / "step_vs_trl.py"
    cases = "default,smollm2-135m-shaped"
    lines = run_script(
        ctx, "step_vs_trl", [script, "--quick", "--repeats", "1", "--cases", cases, "--device", ctx.device]
    )
    return {c["case"]: {"speedup": c["speedup"], "memory_ratio": c["memory_ratio"]} for c in lines}


CHECKS: dict[str, tuple[Callable[[Context], dict], float]] = {  # name: (function, time limit in seconds)
    "environment": (environment, 60),
    "merge_kernels": (merge_kernels, 300),  # the C++/CUDA op's first build takes minutes
    "streaming": (streaming, 120),
    "ipc_mailbox": (ipc_mailbox, 180),
    "hf_engine": (hf_engine, 180),
    "trainer_default": (trainer_default, 240),
    "trainer_smollm2": (trainer_smollm2, 300),
    "fsdp_one_rank": (fsdp_one_rank, 180),
    "merge_throughput": (merge_throughput, 300),
    "step_vs_trl": (step_vs_trl, 400),
}


# --- what the checks share -----------------------------------------------------------------------------------------


def even_token_share(prompts: list, completions: list, completion_ids: list, **_) -> list[float]:
    """The reward of `trainer_smollm2` (TRL's batched signature): the share of a response's tokens with an even id.
    A random model can learn it: `plant_even_token_direction` gives the even tokens' embeddings a common direction."""
    return [sum(1 - t % 2 for t in ids) / max(1, len(ids)) for ids in completion_ids]


def plant_even_token_direction(model_dir: Path) -> None:
    """Moves the (tied) embeddings of even token ids along one coordinate and odd ones against it, so that one
    direction of the last hidden state raises every even token's logit at once: a reward on even tokens is then
    learnable by a LoRA on a random model in a few steps, as a task is by a pre-trained one."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    embedding = tensors["model.embed_tokens.weight"]
    embedding[0::2, 0] += 0.05
    embedding[1::2, 0] -= 0.05
    save_file(tensors, path, metadata={"format": "pt"})


def default_trainer(ctx: Context, name: str, **overrides):
    """A `Trainer` of the embedded default on the check's device (two steps' worth of settings)."""
    from lorarl.trainer.config import load_config
    from lorarl.trainer.loop import Trainer
    from lorarl.trainer.presets import PRESETS

    settings = {"trainer.device": ctx.device, "trainer.output_dir": ctx.out / name, "trainer.steps": 2,
                "trainer.eval_every": 0, "data.batch_size": 8, "rollout.n": 4}  # fmt: skip
    settings |= {key.replace("__", "."): value for key, value in overrides.items()}
    return Trainer(load_config(None, [f"{k}={v}" for k, v in settings.items()], presets=PRESETS))


def child_env() -> dict[str, str]:
    """This environment with the packages' sources first on PYTHONPATH (as the documented command sets it; `main`
    has put the vendored dependencies at its end)."""
    paths = [str(p) for p in SOURCES] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.environ | {"PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def run_trainer(ctx: Context, name: str, overrides: list[str]) -> list[dict]:
    """`python3 -m lorarl.trainer.cli` (no uv) into `--out/name`; its metrics.jsonl records."""
    output = ctx.out / name
    command = [sys.executable, "-m", "lorarl.trainer.cli", *overrides, f"trainer.output_dir={output}"]
    run_child(ctx, name, command, what="the trainer")
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def run_figures(records: list[dict]) -> dict:
    """Steps, the median seconds per step (the first step, warm-up, left out) and the peak GPU memory."""
    steps = [r for r in records if r["step"] > 0]
    seconds = sorted(r["timing/step_s"] for r in steps[1:] or steps)
    figures = {"steps": len(steps), "s_per_step": round(seconds[len(seconds) // 2], 4)}
    peaks = [r["memory/cuda_peak_gb"] for r in steps if "memory/cuda_peak_gb" in r]
    if peaks:
        figures["cuda_peak_gb"] = max(peaks)
    return figures


def run_script(ctx: Context, name: str, command: list) -> list[dict]:
    """A benchmark script's JSON lines, also kept in `--out/name.jsonl`."""
    stdout = run_child(ctx, name, [sys.executable, *map(str, command)], what=name)
    (ctx.out / f"{name}.jsonl").write_text(stdout)
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def run_child(ctx: Context, name: str, command: list[str], *, what: str) -> str:
    """A process of the checks (the packages' sources on its path), its output kept in `--out/name.log`; its stdout,
    or an AssertionError with the end of its stderr if it failed."""
    done = subprocess.run(command, capture_output=True, text=True, env=child_env())
    (ctx.out / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise AssertionError(f"{what} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def pack_vendor(directory: Path) -> list[str]:
    """Copy the installed files of the VENDORED distributions (pure Python: refused otherwise) into `directory`, with
    their metadata; returns `name version` of each."""
    packed = []
    for name in VENDORED:
        dist = importlib.metadata.distribution(name)
        files = [f for f in dist.files or [] if f.parts[0] != ".." and "__pycache__" not in f.parts]
        binary = [str(f) for f in files if f.suffix in (".so", ".pyd", ".dylib")]
        if binary:
            raise SystemExit(f"--pack-vendor: {name} is not pure Python ({binary[0]})")
        for file in files:
            target = directory / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(dist.locate_file(file), target)
        packed.append(f"{name} {dist.version}")
    return packed


# --- the runner ----------------------------------------------------------------------------------------------------


def run_check(name: str, ctx: Context, limit_s: float) -> dict:
    """One check in a process of its own, stopped after `limit_s`: its status, seconds and figures (or error)."""
    result = ctx.out / f".{name}.json"
    command = [sys.executable, __file__, "--check", name, "--device", ctx.device, "--out", str(ctx.out),
               "--result", str(result), *(["--smoke"] if ctx.smoke else [])]  # fmt: skip
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": round(time.monotonic() - started, 1),
                "error": f"stopped after {limit_s:.0f} s"}  # fmt: skip
    outcome = json.loads(result.read_text()) if result.is_file() else {
        "status": "failed", "error": f"exit code {done.returncode}, no result:\n{done.stderr[-3000:]}"}  # fmt: skip
    result.unlink(missing_ok=True)
    return {"seconds": round(time.monotonic() - started, 1), **outcome}


def in_child(ctx: Context, result: Path, function: Callable[[Context], dict]) -> None:
    """The body of a check's process: the checks may import the tests' references and the benchmarks' helpers."""
    for folder in ("packages/lora_merge/tests", "packages/lora_merge/benchmarks", "packages/weight_sync/tests",
                   "packages/trainer/tests", "benchmarks"):  # fmt: skip
        sys.path.insert(0, str(ROOT / folder))
    try:
        outcome = {"status": "ok", "figures": function(ctx)}
    except Skip as e:
        outcome = {"status": "skipped", "reason": str(e)}
    except BaseException as e:
        outcome = {"status": "failed", "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}"}
    if os.environ.get("RANK", "0") == "0":
        result.write_text(json.dumps(outcome, default=str))


def summary(report: dict) -> str:
    """The report as markdown: the environment, then one row per check."""
    env = report["environment"]
    lines = [f"# GPU check: {env.get('gpu', 'no GPU')} ({report['device']}), {report['date']}", "",
             "| | |", "|---|---|"]  # fmt: skip
    lines += [f"| {key} | {value} |" for key, value in env.items()]
    lines += ["", "| check | status | seconds | figures or reason |", "|---|---|---|---|"]
    for name, check in report["checks"].items():
        detail = check.get("figures") or check.get("reason") or (check.get("error") or "").split("\n")[0]
        text = json.dumps(detail) if isinstance(detail, dict) else str(detail)
        lines.append(f"| {name} | {check['status']} | {check.get('seconds', '')} | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory for gpu_check.json, gpu_check.md, logs (required)")
    parser.add_argument("--vendor", type=Path, default=ROOT / "gpu-vendor", help="vendored dependencies (if present)")
    vendored = ", ".join(VENDORED)
    parser.add_argument("--pack-vendor", action="store_true", help=f"copy {vendored} into --vendor, then stop")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when torch sees a GPU")
    parser.add_argument("--smoke", action="store_true", help="tiny models and runs (the test suite's CPU mode)")
    parser.add_argument("--only", help=f"comma-separated checks, from: {', '.join(CHECKS)}")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all checks together")
    parser.add_argument("--check", choices=CHECKS, help=argparse.SUPPRESS)
    parser.add_argument("--fsdp-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pack_vendor:
        print(f"packed into {args.vendor}: {', '.join(pack_vendor(args.vendor))}")
        return 0
    if args.vendor.is_dir() and not (args.check or args.fsdp_rank):  # every check's process inherits it
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, str(args.vendor.resolve())])
    if args.out is None:
        parser.error("--out is required")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args.device, args.smoke, args.out.resolve())
    if args.check or args.fsdp_rank:
        in_child(ctx, args.result, fsdp_rank if args.fsdp_rank else CHECKS[args.check][0])
        return 0
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"--only: unknown checks {unknown}; known: {', '.join(CHECKS)}")
    report = {"device": args.device, "smoke": args.smoke, "date": time.strftime("%Y-%m-%d"), "environment": {},
              "checks": {}}  # fmt: skip
    deadline = time.monotonic() + args.budget
    for name in names:
        limit_s = CHECKS[name][1]
        left = deadline - time.monotonic()
        if left < 10:
            check = {"status": "not run", "reason": f"the --budget of {args.budget:.0f} s was spent"}
        else:
            check = run_check(name, ctx, min(limit_s, left))
        print(f"{name}: {check['status']} ({check.get('seconds', 0)} s)", flush=True)
        if name == "environment" and check["status"] == "ok":
            report["environment"] = check.pop("figures")
        report["checks"][name] = check
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    text = summary(report)
    (args.out / "gpu_check.md").write_text(text)
    print(text)
    return 1 if any(c["status"] in ("failed", "timeout") for c in report["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())

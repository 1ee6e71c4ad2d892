"""Rollouts per second: vLLM (its CPU build on a CPU) against lorarl's HF engine, on the step benchmark's model shapes.

Each case starts each engine in a process of its own — interleaved hf, vllm, hf, vllm — as the trainer starts it
inline (`rollout.worker=inline`: vLLM's worker, the HF engine's decode loop), on the same model, the same
prompts of the embedded task, the case's prompts per step × 8 responses × its max new tokens, sampled at temperature
1 in the engine dtype given (float32 by default: what a CPU without AVX512-BF16 computes fast), vLLM with the KV cache
the trainer would give it (`rollout.vllm.kv_cache_gb` unset: the case's sequences at the trainer's default
`data.max_prompt_tokens`, 512, plus its max new tokens). After one warm-up
batch it times `--batches` batches. Per case it prints one JSON object: `hf_s_per_batch`, `vllm_s_per_batch` (medians
over the runs), `speedup` (HF's time / vLLM's: > 1 is vLLM faster), the tokens generated per second on each side, and
`*_peak_rss_gb` (the engine's whole process tree, sampled every 20 ms).

Run in the vLLM CPU environment (`scripts/vllm_cpu_env.sh --bench`):

    .venv-vllm-cpu/bin/python benchmarks/rollout_throughput.py [--quick] [--cases default,qwen2-46m,...]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from step_vs_trl import CASES, GB, GENERATIONS, case_names, make_model, run_measured

ENGINES = ("hf", "vllm")


def run_engine(engine: str, case_name: str, model: Path, batches: int, dtype: str) -> dict:
    """In this process: start the engine, one warm-up batch, then `batches` timed ones."""
    import torch

    from lorarl.trainer import data
    from lorarl.trainer.engines import SamplingParams
    from lorarl.trainer.models import load_tokenizer

    case = CASES[case_name]
    tokenizer = load_tokenizer(model)
    rows = data.read_rows(["default"], default_file="train.jsonl")
    prompts = [tokenizer(r.fields["prompt"])["input_ids"] for r in rows[: case.prompts * (batches + 1)]]
    if engine == "hf":
        from lorarl.trainer.engines.hf import HFSettings, HFWorker
        from lorarl.trainer.engines.inline import InlineEngine

        settings = HFSettings(str(model), getattr(torch, dtype), "cpu", tokenizer.eos_token_id,
                              tokenizer.pad_token_id, batch_size=256)  # fmt: skip
        runner = InlineEngine(HFWorker(settings))
    else:
        from lorarl.trainer.engines.inline import InlineEngine
        from lorarl.trainer.engines.vllm_worker import VllmSettings, VllmWorker, kv_cache_for

        max_model_len, kv_cache_gb = kv_cache_for(str(model), getattr(torch, dtype), case.prompts * GENERATIONS,
                                                  512 + case.max_tokens)  # fmt: skip
        settings = VllmSettings(str(model), getattr(torch, dtype), 1, 0.5, max_model_len, seed=0, max_lora_rank=None,
                                devices=None, device="cpu", kv_cache_gb=kv_cache_gb, inline=True)  # fmt: skip
        runner = InlineEngine(VllmWorker(settings))
    seconds, tokens = [], []
    for index in range(batches + 1):
        batch = prompts[index * case.prompts : (index + 1) * case.prompts]
        started = time.perf_counter()
        completions = runner.generate(batch, SamplingParams(GENERATIONS, max_tokens=case.max_tokens, seed=index))
        if index:  # the first batch warms up
            seconds.append(time.perf_counter() - started)
            tokens.append(sum(len(c.token_ids) for c in completions))
    runner.close()
    return {"seconds": seconds, "tokens": tokens}


def run_side(engine: str, case_name: str, model: Path, batches: int, dtype: str) -> dict:
    """One engine's run in a fresh process, with its process tree's peak resident memory."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        command = [sys.executable, __file__, "--worker", engine, "--case", case_name, "--model", str(model),
                   "--batches", str(batches), "--dtype", dtype, "--result", result.name]  # fmt: skip
        peak = run_measured(command, f"{engine} on {case_name}")
        outcome = json.loads(Path(result.name).read_text())
    return outcome | {"peak_rss": peak}


def measure(case_name: str, workdir: Path, *, batches: int, repeats: int, dtype: str) -> dict:
    model = make_model(CASES[case_name], workdir)
    runs: dict[str, list[dict]] = {engine: [] for engine in ENGINES}
    for _ in range(repeats):
        for engine in ENGINES:  # interleaved
            runs[engine].append(run_side(engine, case_name, model, batches, dtype))
    case = CASES[case_name]
    out = {"case": case_name, "prompts": case.prompts, "generations": GENERATIONS, "max_tokens": case.max_tokens,
           "dtype": dtype, "timed_batches": batches}  # fmt: skip
    for engine, engine_runs in runs.items():
        per_run = [statistics.median(r["seconds"]) for r in engine_runs]
        out[f"{engine}_s_per_batch"] = statistics.median(per_run)
        out[f"{engine}_runs_s_per_batch"] = [round(s, 4) for s in per_run]
        tokens = sum(sum(r["tokens"]) for r in engine_runs)
        out[f"{engine}_tokens_per_s"] = tokens / sum(sum(r["seconds"]) for r in engine_runs)
        out[f"{engine}_peak_rss_gb"] = max(r["peak_rss"] for r in engine_runs) / GB
    out["speedup"] = out["hf_s_per_batch"] / out["vllm_s_per_batch"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer batches (3 instead of 8)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument("--repeats", type=int, default=2, help="runs of each engine per case, interleaved")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both engines' dtype")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        result = run_engine(args.worker, args.case, Path(args.model), args.batches, args.dtype)
        Path(args.result).write_text(json.dumps(result))
        return
    names = case_names(parser, args.cases)
    with tempfile.TemporaryDirectory(prefix="rollout_throughput-") as workdir:
        for name in names:
            result = measure(
                name, Path(workdir), batches=3 if args.quick else 8, repeats=args.repeats, dtype=args.dtype
            )
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

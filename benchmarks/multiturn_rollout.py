"""Multi-turn rollouts per second: the HF engine against vLLM (its CPU build on a CPU), playing the embedded
calculator task's episodes (`task=calculator`: a turn that calls the tool, its result, a turn that answers).

Each engine starts in a process of its own — interleaved hf, vllm, hf, vllm — as the trainer starts it inline, with
the task's model, environment and settings (`data.batch_size` prompts × `rollout.n` episodes each, sampled at
temperature 1, the turns waiting in one engine call). After one warm-up batch it times `--batches`
batches. Prints one JSON object: per engine the episodes per second, the action tokens per second, turns per episode,
seconds per batch (median over the runs) and the peak RSS of its whole process tree; `vllm_over_hf` (episodes per
second, > 1 is vLLM faster).

Run in the vLLM CPU environment (`scripts/vllm_cpu_env.sh --bench`):

    .venv-vllm-cpu/bin/python benchmarks/multiturn_rollout.py [--quick] [--dtype bfloat16]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from step_vs_trl import GB, run_measured

ENGINES = ("hf", "vllm")


def run_engine(engine: str, batches: int, dtype: str) -> dict:
    """In this process: the task's engine and environment, one warm-up batch, then `batches` timed ones."""
    import torch

    from lorarl.trainer import data
    from lorarl.trainer.config import load_config
    from lorarl.trainer.context import fit_context
    from lorarl.trainer.engines.inline import InlineEngine
    from lorarl.trainer.envs.episodes import episode_runner
    from lorarl.trainer.models import load_tokenizer, resolve_model_path
    from lorarl.trainer.rollout import play_episodes, sampling_params

    config = load_config(None, ["task=calculator"])
    model = resolve_model_path(config.model.path)
    tokenizer = load_tokenizer(model)
    runner = episode_runner(config, tokenizer)
    fit_context(config, model, runner)
    examples, _ = data.load_examples("train", tokenizer, config.data)
    size, eos, pad = config.data.batch_size, tokenizer.eos_token_id, tokenizer.pad_token_id
    if engine == "hf":
        from lorarl.trainer.engines.hf import HFSettings, HFWorker

        worker = HFWorker(HFSettings(str(model), getattr(torch, dtype), "cpu", eos, pad, batch_size=256))
    else:
        from lorarl.trainer.engines.vllm_worker import VllmSettings, VllmWorker, kv_cache_for

        sequence = config.data.max_prompt_tokens + config.env.max_tokens
        max_model_len, kv_cache_gb = kv_cache_for(str(model), getattr(torch, dtype), size * config.rollout.n, sequence)
        worker = VllmWorker(VllmSettings(str(model), getattr(torch, dtype), 1, 0.5, max_model_len, seed=0,
                                         max_lora_rank=None, devices=None, device="cpu", kv_cache_gb=kv_cache_gb,
                                         inline=True))  # fmt: skip
    engine_ = InlineEngine(worker)
    seconds, tokens, turns, episodes = [], [], [], []
    for index in range(batches + 1):
        batch = examples[index * size : (index + 1) * size]
        started = time.perf_counter()
        played = play_episodes(engine_, runner, batch, config.rollout.n, sampling_params(config.rollout, index), 0)
        if index:  # the first batch warms up
            seconds.append(time.perf_counter() - started)
            tokens.append(sum(e.action_tokens for e in played))
            turns.append(sum(len(e.actions) for e in played))
            episodes.append(len(played))
    engine_.close()
    return {"seconds": seconds, "tokens": tokens, "turns": turns, "episodes": episodes}


def run_side(engine: str, batches: int, dtype: str) -> dict:
    """One engine's run in a fresh process, with its process tree's peak resident memory."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        command = [sys.executable, __file__, "--worker", engine, "--batches", str(batches), "--dtype", dtype,
                   "--result", result.name]  # fmt: skip
        peak = run_measured(command, f"{engine} playing episodes")
        return json.loads(Path(result.name).read_text()) | {"peak_rss": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer batches (3 instead of 8)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each engine, interleaved")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both engines' dtype")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        Path(args.result).write_text(json.dumps(run_engine(args.worker, args.batches, args.dtype)))
        return
    batches = 3 if args.quick else 8
    runs: dict[str, list[dict]] = {engine: [] for engine in ENGINES}
    for _ in range(args.repeats):
        for engine in ENGINES:  # interleaved
            runs[engine].append(run_side(engine, batches, args.dtype))
    out = {"case": "calculator", "dtype": args.dtype, "timed_batches": batches}
    for engine, engine_runs in runs.items():
        seconds = sum(sum(r["seconds"]) for r in engine_runs)
        out[f"{engine}_episodes_per_s"] = sum(sum(r["episodes"]) for r in engine_runs) / seconds
        out[f"{engine}_action_tokens_per_s"] = sum(sum(r["tokens"]) for r in engine_runs) / seconds
        out[f"{engine}_turns_per_episode"] = sum(sum(r["turns"]) for r in engine_runs) / sum(
            sum(r["episodes"]) for r in engine_runs
        )
        out[f"{engine}_runs_s_per_batch"] = [round(statistics.median(r["seconds"]), 4) for r in engine_runs]
        out[f"{engine}_peak_rss_gb"] = max(r["peak_rss"] for r in engine_runs) / GB
    out["vllm_over_hf"] = out["vllm_episodes_per_s"] / out["hf_episodes_per_s"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

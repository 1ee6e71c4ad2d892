"""Routing replay (R3, `algorithm.routing_replay`): how often the trainer routes tokens to other experts than the
rollout engine did, what that does to the log-probs, whether replay learns as well, and what it costs.

- `mismatch`: the HF engine samples (and records each token's experts) 32 default-task prompts x 4 responses of 16
  tokens, in bf16 or fp32; the trainer scores them in fp32 through its own micro-batches (padded, shared prompts: its
  CPU layout), without and with replay. Per side: `rollout/route_mismatch` (in any layer, and per layer),
  `rollout/route_mismatch_live` (what the routers would choose themselves), `rollout/abs_logp_diff` over every
  response token, and `rollout/abs_logp_diff_rerouted` over the tokens whose routers would choose otherwise — the
  trainer's own metrics, computed by its code; and both sides' |Δ log p| on the same tokens, those rerouted without
  replay. Models: the embedded `default-moe` (3 layers, 8 experts, top-2), pre-trained, and a random Qwen3-MoE of 12
  layers, 32 experts, top-4, its weights drawn at transformers' default scale (0.02) and at 0.1.
- `learning`: `trainer model.path=default-moe actor.lr=3e-4 rollout.dtype=bfloat16` for `--steps` (120), `--seeds`
  (1,2,3), without and with `algorithm.routing_replay=true`, the sides interleaved: validation accuracy at the end.
- `overhead`: the same job with the engine in fp32 (replay then changes nothing in the run: the same steps), 40 steps,
  `--rounds` (3) runs a side interleaved: routes off (`rollout.record_routes=never`), recorded and compared (the
  default), replayed; each side's median `timing/step_s` and its ratio to routes off.

    uv run python benchmarks/routing_replay.py [--parts mismatch,learning,overhead] [--quick]
        # then: scripts/results.py record routing_replay
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def random_mixture(directory: Path, init: float) -> Path:
    """A random Qwen3-MoE of 12 layers, 32 experts, top-4, its weights drawn with standard deviation `init`, with the
    default task's tokenizer."""
    import transformers

    from lorarl.trainer import default_task

    torch.manual_seed(0)
    tokenizer = default_task.build_tokenizer()
    config = transformers.Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                                         moe_intermediate_size=64, num_hidden_layers=12, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32, num_experts=32, num_experts_per_tok=4,
                                         norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=True,
                                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                         bos_token_id=None, initializer_range=init)  # fmt: skip
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def mismatch(model_dir: Path, name: str, engine_dtype: torch.dtype, prompts: int) -> list[dict]:
    """One model, one engine dtype: the trainer's metrics of the same rollouts without and with replay."""
    import transformers

    from lorarl.trainer import algorithms, default_task
    from lorarl.trainer.engines.base import SamplingParams
    from lorarl.trainer.engines.hf import HFSettings, generate_with_hf
    from lorarl.trainer.logprobs import micro_batch, response_logprobs
    from lorarl.trainer.rollout import Sample
    from lorarl.trainer.routing import Routers, attach, route_metrics
    from lorarl.trainer.update import rerouted_tokens, sample_routes

    tokenizer = default_task.build_tokenizer()
    ids = [tokenizer(p["prompt"])["input_ids"] for p in default_task.problems(prompts, validation=False, seed=1)]
    engine = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=engine_dtype).eval()
    settings = HFSettings(str(model_dir), engine_dtype, "cpu", tokenizer.eos_token_id, tokenizer.pad_token_id, 256,
                          record_routes=True)  # fmt: skip
    completions = generate_with_hf(engine, settings, 0, ids, SamplingParams(n=4, max_tokens=16, seed=7))
    samples = [Sample(ids[c.prompt_index], c, c.prompt_index, 0.0, 0.0) for c in completions]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routers = Routers.of(model)
    attach(routers)
    routes = sample_routes(samples, routers)
    responses = [s.completion.token_ids for s in samples]
    width = max(map(len, responses))
    rollout = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        rollout[i, : len(responses[i])] = torch.tensor(s.completion.logprobs)
    mask = torch.arange(width)[None, :] < torch.tensor([len(r) for r in responses])[:, None]
    rows, rerouted = [], None
    for replay in (False, True):
        micro = micro_batch([s.prompt_ids for s in samples], responses, width, "cpu", "padded", share_prompts=True,
                            routes=routes, replay=replay)  # fmt: skip
        with torch.no_grad():
            logp, _ = response_logprobs(model, micro)
        used, live = rerouted_tokens(micro)
        metrics = algorithms.rollout_mismatch(logp, rollout, mask)
        metrics |= route_metrics(used, live, routers.layers, logp, rollout, mask)
        if rerouted is None:  # the tokens the routers send elsewhere without replay: both sides measured on them
            rerouted = live.any(-1) & mask
        on_them = (logp - rollout).abs()[rerouted]
        metrics["abs_logp_diff_on_tokens_rerouted_without_replay"] = float(on_them.mean()) if on_them.numel() else None
        rows.append({"part": "mismatch", "model": name, "engine_dtype": str(engine_dtype).removeprefix("torch."),
                     "trainer_dtype": "float32", "replay": replay, "tokens": int(mask.sum()),
                     **{k: v for k, v in metrics.items() if "rout" in k or "abs_logp" in k}})  # fmt: skip
    return rows


def train(seed: int, steps: int, workdir: Path, *extra: str) -> list[dict]:
    """One run of the trainer's command in a fresh process; its metrics rows."""
    output = Path(tempfile.mkdtemp(dir=workdir))
    command = [sys.executable, "-m", "lorarl.trainer.cli", "model.path=default-moe", "actor.lr=3e-4",
               f"trainer.seed={seed}", f"trainer.steps={steps}", f"trainer.output_dir={output}", *extra]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.mean(values) if values else None


def learning(seeds: list[int], steps: int, workdir: Path) -> list[dict]:
    sides = {False: (), True: ("algorithm.routing_replay=true",)}
    runs = {replay: {} for replay in sides}
    for seed in seeds:  # the sides interleaved
        for replay, extra in sides.items():
            runs[replay][seed] = train(seed, steps, workdir, "rollout.dtype=bfloat16", *extra)
    rows = []
    for replay, by_seed in runs.items():
        curves = {seed: [r["val/accuracy"] for r in rows_ if "val/accuracy" in r] for seed, rows_ in by_seed.items()}
        every = [r for rows_ in by_seed.values() for r in rows_]
        rows.append({"part": "learning", "model": "default-moe", "engine_dtype": "bfloat16", "replay": replay,
                     "steps": steps, "seeds": seeds, "final_accuracy": [c[-1] for c in curves.values()],
                     "mean_final_accuracy": statistics.mean(c[-1] for c in curves.values()),
                     "accuracy_curves": curves,
                     **{key: mean_of(every, key) for key in ("rollout/route_mismatch", "rollout/route_mismatch_live",
                                                             "rollout/abs_logp_diff",
                                                             "rollout/abs_logp_diff_rerouted")},
                     "s_per_step": statistics.median(r["timing/step_s"] for r in every if "timing/step_s" in r)})
    return rows  # fmt: skip


def overhead(rounds: int, steps: int, workdir: Path) -> list[dict]:
    sides = {"off": ("rollout.record_routes=never",), "recorded": (), "replayed": ("algorithm.routing_replay=true",)}
    times = {side: [] for side in sides}
    for _ in range(rounds):  # the sides interleaved
        for side, extra in sides.items():
            rows = train(1, steps, workdir, "rollout.dtype=float32", "trainer.eval_every=0", *extra)
            times[side].append(statistics.median(r["timing/step_s"] for r in rows if "timing/step_s" in r))
    base = statistics.median(times["off"])
    return [{"part": "overhead", "model": "default-moe", "side": side, "steps": steps, "s_per_step": values,
             "ratio_to_off": statistics.median(values) / base} for side, values in times.items()]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="mismatch,learning,overhead", help="which parts, comma-separated")
    parser.add_argument("--seeds", default="1,2,3", help="learning: trainer.seed values, comma-separated")
    parser.add_argument("--steps", type=int, default=120, help="learning: training steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="overhead: runs a side")
    parser.add_argument("--quick", action="store_true", help="8 prompts; one seed of 20 steps; one overhead round")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = set(parts) - {"mismatch", "learning", "overhead"}
    if unknown:
        parser.error(f"--parts: mismatch, learning or overhead; got {', '.join(sorted(unknown))}")
    try:
        seeds = [1] if args.quick else [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: integers, comma-separated; got {args.seeds!r}")
    from lorarl.trainer import default_task

    with tempfile.TemporaryDirectory(prefix="routing_replay-") as scratch:
        workdir = Path(scratch)
        if "mismatch" in parts:
            models = {"default-moe": default_task.EMBEDDED["default-moe"]}
            for init in (0.02, 0.1):  # transformers' default, and weights 5x larger: experts that move the output
                models[f"random-12-layers-32-experts-top-4-init-{init}"] = random_mixture(workdir / str(init), init)
            for name, directory in models.items():
                for dtype in (torch.bfloat16, torch.float32):
                    emit(mismatch(directory, name, dtype, 8 if args.quick else 32))
        if "learning" in parts:
            emit(learning(seeds, 20 if args.quick else args.steps, workdir))
        if "overhead" in parts:
            emit(overhead(1 if args.quick else args.rounds, 10 if args.quick else 40, workdir))


def emit(rows: list[dict]) -> None:
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

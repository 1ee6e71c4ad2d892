"""The RL step, lorarl against TRL's GRPOTrainer on the same work: one JSON object per case.

Each case runs lorarl's trainer and TRL's `GRPOTrainer` in processes of their own, interleaved A, B, A, B, on the same
model, tokenizer, prompts, reward and settings:
- the same prompts per step, `rollout.n` = `num_generations` = 8 responses each, the same max new tokens;
- LoRA rank 16, alpha 32 on all linear layers; AdamW at the same constant learning rate, no warmup, grad clip 1.0;
- GRPO advantages (group mean and std), token-mean loss (TRL's `dapo`), clip 0.2, one optimizer step per batch;
- no KL term, so neither side runs a reference model (TRL's `beta=0`, lorarl's `algorithm.kl_coef=0`);
- fp32 training on both sides (TRL defaults to bf16: `bf16=False`), or with `--train-dtype bfloat16` a bf16 base model
  on both (lorarl's `model.dtype=bfloat16`; TRL's model loaded in bf16, with its default `bf16=True` autocast), LoRA
  weights in fp32 on both (peft's); with `--autocast bfloat16` a float32 model trained under bf16 autocast on both
  (lorarl's `actor.autocast=bfloat16`, TRL's `bf16=True`); no gradient checkpointing (TRL defaults to it:
  `gradient_checkpointing=False`), or with `--gradient-checkpointing` on both (TRL's `gradient_checkpointing=True`,
  lorarl's `actor.gradient_checkpointing=true`: every decoder layer recomputed in the backward, non-reentrant on both);
  TRL trains the whole batch in one micro-batch (`gradient_accumulation_steps=1`, its fastest setting), lorarl at its
  default `actor.micro_batch_tokens`;
- sampling: TRL without vLLM generates with its training model (in the training dtype); lorarl's engine at its default
  `rollout.dtype=auto` samples in bf16 where the CPU computes it natively, as a vLLM engine would (the JSON's
  `lorarl_rollout_dtype`). `--rollout-dtype float32` makes lorarl sample in fp32 too.
- `--rollout-engine vllm`: vLLM generates on both sides — lorarl's `rollout.engine=vllm` (inline: in its process),
  TRL's `use_vllm=True, vllm_mode="colocate"` (in its process too) — with the same engine settings on both: the dtype
  (`--rollout-dtype`, `auto` resolved as lorarl resolves it), eager mode and the KV cache size on a CPU (vLLM's CPU
  build; TRL's `LLM` call is given them, as it has no keys of its own for them). On a CPU TRL's colocated weight sync
  runs inside vLLM's layerwise reload, without which it fails there (`within_layerwise_reload`). Run it in the vLLM
  CPU environment:
  `scripts/vllm_cpu_env.sh --bench`, then `.venv-vllm-cpu/bin/python benchmarks/step_vs_trl.py --rollout-engine vllm`.

The decode-bound cases (`*-long64`, `*-long256`, `*-small-vocab`) run every response to its max tokens: end-of-sequence
is removed from the sampling distribution until then, as an RL run early in training produces (lorarl's
`rollout.min_tokens`, TRL's `min_new_tokens` — `min_tokens` with vLLM).

Per case it prints `case, lorarl_s_per_step, trl_s_per_step, speedup` (TRL's time / lorarl's: > 1 is lorarl faster),
`lorarl_peak_rss_gb, trl_peak_rss_gb` (the sum of the resident memory of the whole process tree, the rollout worker
included, sampled every 20 ms) and the mean reward of the last steps on both sides. Seconds per step are the medians,
over the runs, of the wall time between the ends of consecutive steps after the warm-up steps. lorarl's C++ merge op
is JIT-built once per machine (then cached): it is built before the first run, so no compiler counts in a tree.

It also prints what bounds the update: `*_update_gflop` (the model FLOPs of one step's update: a forward and a
backward of the policy on every token of the batch — the frozen base's input gradients, no weight gradients, the LoRA
factors' both, the LM head on response tokens only, causal attention — `update_flops`), each side's `*_update_s`
(lorarl's `timing/train_s`; TRL's step less its `_generate_and_score_completions`) and `*_update_peak_share`: the
update's achieved FLOP/s over `matmul_peak_gflops`, a plain large matmul in the update's dtype timed in the same run.

    uv run --group bench python benchmarks/step_vs_trl.py [--quick] [--cases default,qwen2-46m,smollm2-135m-shaped]
        [--rollout-dtype auto|float32|bfloat16] [--train-dtype float32|bfloat16] [--gradient-checkpointing]
        [--autocast none|bfloat16] [--device cpu|cuda] [--rollout-engine hf|vllm]

On a GPU (`--device cuda`) each side also reports the peak GPU memory torch allocated in its process (`*_cuda_peak_gb`;
lorarl's engine is in that process).
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class Case:
    name: str
    prompts: int  # per step
    max_tokens: int  # new tokens per response
    warmup: int  # steps not timed
    steps: int  # timed steps (full run; --quick takes a third, at least 2)
    lr: float
    model: dict | None  # a random model of this config (None: the embedded default)
    run_to_max: bool = False  # responses run to max_tokens (end-of-sequence suppressed until then)


QWEN2_46M = {
    "model_type": "qwen2", "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32768, "tie_word_embeddings": True,
    "max_position_embeddings": 1024}  # fmt: skip
QWEN3_MOE_TINY = {
    "model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 16,
    "num_experts_per_tok": 4, "vocab_size": 2048, "tie_word_embeddings": True,
    "max_position_embeddings": 1024}  # fmt: skip
CASES = {
    "default": Case("default", 32, 8, 2, 30, 1e-3, None),  # steps of ~0.2 s: many, or the noise dominates
    "qwen2-46m": Case("qwen2-46m", 2, 64, 1, 9, 1e-4, QWEN2_46M),
    "smollm2-135m-shaped": Case("smollm2-135m-shaped", 8, 16, 1, 6, 1e-4, {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5}),
    # decode-bound: every response runs to max_tokens
    "qwen2-46m-long64": Case("qwen2-46m-long64", 2, 64, 1, 9, 1e-4, QWEN2_46M, run_to_max=True),
    "qwen2-46m-long256": Case("qwen2-46m-long256", 2, 256, 1, 6, 1e-4, QWEN2_46M, run_to_max=True),
    "qwen2-30m-small-vocab": Case("qwen2-30m-small-vocab", 2, 256, 1, 6, 1e-4, {**QWEN2_46M, "vocab_size": 2048},
                                  run_to_max=True),
    # a mixture of experts (transformers 5's fused experts): LoRA on them through peft's target_parameters on both
    # sides (TRL's all-linear adapts the router too, lorarl's keeps it frozen)
    "qwen3-moe-tiny": Case("qwen3-moe-tiny", 4, 32, 1, 6, 1e-4, QWEN3_MOE_TINY),
}  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """What both sides of every case share."""

    rollout_dtype: str  # lorarl's rollout.dtype
    train_dtype: str  # the base model's dtype on both sides
    gradient_checkpointing: bool  # on both sides
    device: str
    rollout_engine: str = "hf"  # lorarl's rollout.engine; "vllm": TRL generates with vLLM too
    autocast: str = "none"  # bfloat16: both sides train under torch.autocast (lorarl's actor.autocast, TRL's bf16)


GENERATIONS = 8
RANK, ALPHA = 16, 32.0
SEED = 0
VLLM_KV_CACHE_GB = 1.0  # a vLLM engine's KV cache on a CPU, on both sides


def engine_dtype(settings: Settings):
    """The rollout engine's dtype: `--rollout-dtype`, with `auto` resolved as lorarl's trainer resolves it."""
    import torch

    from lorarl.trainer.models import rollout_dtype

    return rollout_dtype(settings.rollout_dtype, getattr(torch, settings.train_dtype), torch.device(settings.device))


def make_model(case: Case, directory: Path, *, checkpoint_dtype: str = "float32") -> Path:
    """The case's model directory: the embedded default, or a random model (seeded, saved in `checkpoint_dtype`) with
    the default task's tokenizer widened to the model's vocabulary (its extra tokens decode to words the reward never
    accepts)."""
    from lorarl.trainer import default_task

    if case.model is None:
        return default_task.MODEL_DIR
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(case.model)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings, eos_token_id=1, pad_token_id=0,
                                  bos_token_id=None)  # fmt: skip
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = directory / case.name
    model.to(getattr(torch, checkpoint_dtype)).save_pretrained(path)
    default_task.build_tokenizer(vocab_size=config.vocab_size).save_pretrained(path)
    return path


# --- the two sides, each run in a process of its own ---------------------------------------------------------------


def run_lorarl(case: Case, model: Path, output: Path, steps: int, settings: Settings) -> dict:
    from lorarl.trainer.config import load_config
    from lorarl.trainer.loop import Trainer

    config = load_config(overrides=[
        f"model.path={model}", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}",
        f"data.batch_size={case.prompts}", f"rollout.n={GENERATIONS}", f"rollout.max_tokens={case.max_tokens}",
        f"actor.lr={case.lr}", f"rollout.dtype={settings.rollout_dtype}", f"model.dtype={settings.train_dtype}",
        "algorithm.kl_coef=0", f"trainer.steps={steps}", "trainer.eval_every=0", f"trainer.output_dir={output}",
        f"trainer.seed={SEED}", f"trainer.device={settings.device}",
        f"actor.gradient_checkpointing={settings.gradient_checkpointing}",
        f"rollout.engine={settings.rollout_engine}", f"rollout.vllm.kv_cache_gb={VLLM_KV_CACHE_GB}",
        f"actor.autocast={settings.autocast}", f"rollout.min_tokens={case.max_tokens if case.run_to_max else 0}",
    ])  # fmt: skip
    trainer = Trainer(config)
    ends, rewards, updates, lengths, threads = [], [], [], [], []
    train_step = trainer.train_step

    def timed_step(step: int) -> dict:
        metrics = train_step(step)
        ends.append(time.perf_counter())
        rewards.append(metrics["reward/mean"])
        updates.append(metrics["timing/train_s"])
        lengths.append(metrics["response_length/mean"])
        threads.append(metrics["threads"])
        return metrics

    trainer.train_step = timed_step
    trainer.run()
    return {
        "step_ends": ends,
        "rewards": rewards,
        "update_s": updates,
        "response_lengths": lengths,
        "threads": threads,
        "rollout_dtype": str(trainer.rollout_dtype).removeprefix("torch."),
        **cuda_peak(settings.device),
    }


def run_trl(case: Case, model_path: Path, output: Path, steps: int, settings: Settings) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lorarl.trainer import data, default_task
    from lorarl.trainer.models import load_tokenizer

    rows = data.read_rows(["default"], default_file="train.jsonl")
    dataset = Dataset.from_list([{"prompt": r.fields["prompt"], "answer": r.fields["answer"]} for r in rows])

    def reward(prompts, completions, answer, **_) -> list[float]:
        return [default_task.reward(p, c, a) for p, c, a in zip(prompts, completions, answer, strict=True)]

    begins, ends, rewards, generations, lengths = [], [], [], [], []

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            begins.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])
                lengths.append(logs["completions/mean_length"])

    class TimedGRPOTrainer(GRPOTrainer):  # a step = generating and scoring, then the update
        def _generate_and_score_completions(self, inputs):
            started = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                generations.append(time.perf_counter() - started)

    samples = case.prompts * GENERATIONS
    bf16 = update_dtype(settings) == "bfloat16"  # HF Trainer: bf16 autocast
    vllm = settings.rollout_engine == "vllm"
    run_to_max = {("min_tokens" if vllm else "min_new_tokens"): case.max_tokens} if case.run_to_max else None
    if vllm:  # TRL has no keys for these: its LLM call gets what lorarl's engine has
        from functools import partial

        import trl.generation.vllm_generation as trl_vllm

        engine = {"dtype": str(engine_dtype(settings)).removeprefix("torch.")}
        if settings.device == "cpu":
            engine.update(enforce_eager=True, kv_cache_memory_bytes=int(VLLM_KV_CACHE_GB * (1 << 30)))
        trl_vllm.LLM = partial(trl_vllm.LLM, **engine)
        trl_vllm.VLLMGeneration.sync_weights = within_layerwise_reload(trl_vllm.VLLMGeneration.sync_weights)
    args = GRPOConfig(
        output_dir=str(output), max_steps=steps, per_device_train_batch_size=samples, gradient_accumulation_steps=1,
        num_generations=GENERATIONS, max_completion_length=case.max_tokens, temperature=1.0, top_p=1.0,
        learning_rate=case.lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
        beta=0.0, loss_type="dapo", epsilon=0.2, bf16=bf16, gradient_checkpointing=settings.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        use_cpu=settings.device == "cpu", use_vllm=vllm, vllm_mode="colocate", generation_kwargs=run_to_max,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=SEED,
    )  # fmt: skip
    trainer = TimedGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, settings.train_dtype)),
        reward_funcs=reward, args=args, train_dataset=dataset, processing_class=load_tokenizer(model_path),
        peft_config=LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0),
        callbacks=[Timing()],
    )  # fmt: skip
    trainer.train()
    steps = [end - begin for begin, end in zip(begins, ends, strict=True)]
    return {
        "step_ends": ends,
        "rewards": rewards,
        "update_s": [step - generating for step, generating in zip(steps, generations, strict=True)],
        "response_lengths": lengths,
        # without vLLM it samples with its training model
        "rollout_dtype": str(engine_dtype(settings)).removeprefix("torch.") if vllm else settings.train_dtype,
        **cuda_peak(settings.device),
    }


def within_layerwise_reload(sync_weights):
    """TRL's colocated weight sync (`load_weights`, one parameter at a time), inside vLLM's layerwise reload: vLLM's
    CPU backend repacks its linear weights after loading and drops the originals, so TRL's plain `load_weights`
    fails there ("'Parameter' object has no attribute 'weight_loader'"); the reload restores the layers, loads, and
    repacks each as its weights complete: the fix TRL needs for any engine that processes weights after loading."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    def wrapped(self) -> None:
        engine = self.llm.llm_engine
        model = engine.model_executor.driver_worker.model_runner.model
        initialize_layerwise_reload(model)
        try:
            sync_weights(self)
        finally:
            finalize_layerwise_reload(model, engine.vllm_config.model_config)

    return wrapped


def cuda_peak(device: str) -> dict:
    """The peak GPU memory torch allocated in this side's process (lorarl's engine too: rollout.worker=inline)."""
    import torch

    return {"cuda_peak_gb": torch.cuda.max_memory_allocated() / GB} if device == "cuda" else {}


SIDES = {"lorarl": run_lorarl, "trl": run_trl}


# --- the driver ----------------------------------------------------------------------------------------------------


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total


def run_measured(command: list[str], what: str) -> int:
    """Run `command` to its end, sampling the resident memory of its process tree every 20 ms; returns the peak
    (bytes). Raises with the end of its stderr if it fails."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(process.stderr), daemon=True)
    reader.start()
    while process.poll() is None:
        peak = max(peak, tree_rss(process.pid))
        time.sleep(0.02)
    reader.join()
    if process.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{''.join(stderr[-40:])}")
    return peak


def run_side(side: str, case: Case, model: Path, workdir: Path, steps: int, settings: Settings) -> dict:
    """One run in a fresh process; its seconds per step (median interval after the warm-up) and peak tree RSS."""
    output = Path(tempfile.mkdtemp(dir=workdir, prefix=f"{side}-"))
    result_file = output / "result.json"
    command = [sys.executable, __file__, "--worker", side, "--case", case.name, "--model", str(model),
               "--output", str(output), "--steps", str(steps), "--result", str(result_file),
               "--max-tokens", str(case.max_tokens),
               "--rollout-dtype", settings.rollout_dtype, "--train-dtype", settings.train_dtype,
               "--device", settings.device, "--rollout-engine", settings.rollout_engine,
               "--autocast", settings.autocast]  # fmt: skip
    if settings.gradient_checkpointing:
        command.append("--gradient-checkpointing")
    peak = run_measured(command, f"{side} on {case.name}")
    result = json.loads(result_file.read_text())
    ends = result["step_ends"]
    intervals = [b - a for a, b in zip(ends[case.warmup - 1 :], ends[case.warmup :], strict=False)]
    return {
        "s_per_step": statistics.median(intervals),
        "update_s": statistics.median(result["update_s"][case.warmup :]),
        "response_tokens": statistics.mean(result["response_lengths"][case.warmup :]),
        "peak_rss": peak,
        "rewards": result["rewards"],
        "rollout_dtype": result["rollout_dtype"],
        "cuda_peak_gb": result.get("cuda_peak_gb"),
    }


def update_flops(model_dir: Path, sequences: int, prompt_tokens: float, response_tokens: float) -> float:
    """The model FLOPs of one update of LoRA rank `RANK` on every linear layer: a forward and a backward of each
    sequence's inputs (its tokens but the last) — per token, a frozen linear's forward and input gradient (4·in·out),
    its LoRA factors' forward, input and weight gradients (6·r·(in + out)); the LM head's forward and input gradient
    at the positions that predict response tokens (what the loss reads); causal attention (scores and values, forward
    and backward: 6·heads·head_dim·length² per layer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    per_token = sum(4 * m.in_features * m.out_features + 6 * RANK * (m.in_features + m.out_features) for m in linears)
    length = prompt_tokens + response_tokens - 1
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * head_dim * length**2
    head_flops = 4 * head.in_features * head.out_features * response_tokens
    return sequences * (length * per_token + attention + head_flops)


def mean_prompt_tokens(model_dir: Path) -> float:
    """The training prompts' mean length in the case's tokens (each step draws its prompts from them)."""
    from lorarl.trainer import data
    from lorarl.trainer.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    rows = data.read_rows(["default"], default_file="train.jsonl")
    return statistics.mean(len(tokenizer.encode(r.fields["prompt"])) for r in rows)


def matmul_peak(dtype: str, device: str, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` plain `size`³ matmuls in `dtype`: the machine's peak the update is held to."""
    import torch

    a, b = (torch.randn(size, size, device=device).to(getattr(torch, dtype)) for _ in range(2))
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        started = time.perf_counter()
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


def update_dtype(settings: Settings) -> str:
    """The dtype the update's matmuls run in."""
    return "bfloat16" if "bfloat16" in (settings.train_dtype, settings.autocast) else settings.train_dtype


def measure(case: Case, workdir: Path, *, quick: bool, repeats: int, settings: Settings) -> dict:
    model = make_model(case, workdir)
    timed = max(2, case.steps // 3) if quick else case.steps
    steps = case.warmup + timed
    runs: dict[str, list[dict]] = {"lorarl": [], "trl": []}
    peaks = []
    for _ in range(repeats):
        peaks.append(matmul_peak(update_dtype(settings), settings.device))
        for side in ("lorarl", "trl"):  # interleaved: A, B, A, B
            runs[side].append(run_side(side, case, model, workdir, steps, settings))
    out = {"case": case.name, "prompts": case.prompts, "generations": GENERATIONS, "max_tokens": case.max_tokens,
           "timed_steps": timed, "train_dtype": settings.train_dtype, "rollout_engine": settings.rollout_engine,
           "gradient_checkpointing": settings.gradient_checkpointing}  # fmt: skip
    for side, side_runs in runs.items():
        out.update(summary(side, side_runs))
        last = max(1, timed // 2)
        out[f"{side}_final_reward"] = statistics.mean(r for run in side_runs for r in run["rewards"][-last:])
        out[f"{side}_rollout_dtype"] = side_runs[0]["rollout_dtype"]
        if settings.device == "cuda":
            out[f"{side}_cuda_peak_gb"] = max(r["cuda_peak_gb"] for r in side_runs)
    out["speedup"] = out["trl_s_per_step"] / out["lorarl_s_per_step"]
    out["memory_ratio"] = out["lorarl_peak_rss_gb"] / out["trl_peak_rss_gb"]
    peak = max(peaks)
    out["matmul_peak_gflops"] = peak / 1e9
    out["update_dtype"] = update_dtype(settings)
    prompt_tokens = mean_prompt_tokens(model)
    for side, side_runs in runs.items():
        response_tokens = statistics.mean(r["response_tokens"] for r in side_runs)
        flops = update_flops(model, case.prompts * GENERATIONS, prompt_tokens, response_tokens)
        update_s = statistics.median(r["update_s"] for r in side_runs)
        out[f"{side}_response_tokens"] = response_tokens
        out[f"{side}_update_s"] = update_s
        out[f"{side}_update_gflop"] = flops / 1e9
        out[f"{side}_update_peak_share"] = flops / update_s / peak
    return out


def summary(prefix: str, runs: list[dict]) -> dict:
    """One side's runs: seconds per step (the median over the runs, and each run's) and the peak tree RSS."""
    return {
        f"{prefix}_s_per_step": statistics.median(r["s_per_step"] for r in runs),
        f"{prefix}_runs_s_per_step": [round(r["s_per_step"], 4) for r in runs],
        f"{prefix}_peak_rss_gb": max(r["peak_rss"] for r in runs) / GB,
    }


def case_names(parser: argparse.ArgumentParser, cases: str) -> list[str]:
    """The names of `--cases`, each one of CASES (else the parser's error)."""
    names = cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; expected names from {list(CASES)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer timed steps (within 10 minutes on 2 vCPUs)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side per case, interleaved")
    parser.add_argument(
        "--rollout-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="lorarl's rollout.dtype (TRL samples with its training model)",
    )
    parser.add_argument(
        "--train-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the base model's dtype on both sides (LoRA weights stay fp32)",
    )
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="both sides recompute every decoder layer in the backward"
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both sides train and sample")
    parser.add_argument("--rollout-engine", default="hf", choices=("hf", "vllm"),
                        help="lorarl's engine; vllm: both sides generate with vLLM (TRL's colocate mode)")  # fmt: skip
    parser.add_argument("--autocast", default="none", choices=("none", "bfloat16"),
                        help="bfloat16: both sides train a float32 model under bf16 autocast (lorarl's actor.autocast, "
                        "TRL's bf16=True)")  # fmt: skip
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, help=argparse.SUPPRESS)  # the case's, or another's (a variant)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    settings = Settings(args.rollout_dtype, args.train_dtype, args.gradient_checkpointing, args.device,
                        args.rollout_engine, args.autocast)  # fmt: skip
    if args.worker:
        side = SIDES[args.worker]
        case = replace(CASES[args.case], max_tokens=args.max_tokens)
        result = side(case, Path(args.model), Path(args.output), args.steps, settings)
        Path(args.result).write_text(json.dumps(result))
        return
    names = case_names(parser, args.cases)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lorarl.lora_merge import available_backends

    available_backends(args.device)  # lorarl's C++ merge op is built on first use, then cached: not inside a timed run
    with tempfile.TemporaryDirectory(prefix="step_vs_trl-") as workdir:
        for name in names:
            result = measure(CASES[name], Path(workdir), quick=args.quick, repeats=args.repeats, settings=settings)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

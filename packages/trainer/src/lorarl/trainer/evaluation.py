"""Validation during a run (greedy answers to the held-out prompts, scored by the run's reward), and `trainer eval`:
greedy accuracy and pass@k of a saved checkpoint or merged model."""

import math
from pathlib import Path

import numpy as np

from lorarl.trainer import data, scoring, threads
from lorarl.trainer.context import fit_context
from lorarl.trainer.engines import RolloutEngine
from lorarl.trainer.envs.episodes import EpisodeRunner, episode_runner
from lorarl.trainer.rewards import RewardError
from lorarl.trainer.rollout import episode_returns, final_responses, greedy_scores, play_episodes, responses


def evaluate(engine: RolloutEngine, examples: list[data.Example], tokenizer, reward: scoring.Rewards, *,
             max_tokens: int, version: int, episodes: EpisodeRunner | None = None) -> dict:  # fmt: skip
    """Mean reward, and accuracy (the share with full reward, >= 1), of the engine's greedy answers (greedy
    episodes, with `episodes`) from weights `version`."""
    try:
        scores = greedy_scores(engine, examples, tokenizer, reward, max_tokens=max_tokens, version=version,
                               episodes=episodes)  # fmt: skip
    except RewardError as error:  # where it happened: before any training, or after step `version`
        when = "the validation before training (step 0)" if version == 0 else f"the validation after step {version}"
        raise RewardError(f"{error.problem} in {when}", error.response) from None
    return {"val/reward": float(np.mean(scores)), "val/accuracy": float(np.mean([s >= 1.0 for s in scores]))}


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The chance that at least one of k of the n samples is correct, `correct` of them being so: the unbiased
    estimator 1 - C(n - c, k) / C(n, k) of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code")."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - correct + 1, n + 1))


def evaluate_checkpoint(directory: str | Path, overrides: list[str], *, n: int) -> dict:
    """Greedy accuracy and reward, and pass@k of `n` samples per prompt at `rollout.temperature`, on `data.val_files`:
    of a checkpoint (its policy adapter on `model.path`, or its full model; the run's `config.yaml`, then `overrides`)
    or of a merged model directory (`trainer export`'s; the settings from `overrides`)."""
    from lorarl.trainer.config import load_config
    from lorarl.trainer.engines import SamplingParams
    from lorarl.trainer.engines.hf import HFSettings, generate_with_hf
    from lorarl.trainer.errors import TrainerError
    from lorarl.trainer.models import DTYPES, load_base, load_tokenizer, resolve_device, resolve_model_path
    from lorarl.trainer.presets import PRESETS

    directory = Path(directory)
    saved = directory / "config.yaml"
    config = load_config(saved if saved.is_file() else None, overrides, presets=PRESETS)
    threads.configure(config.trainer.threads)
    device, dtype = resolve_device(config.trainer.device), DTYPES[config.model.dtype]
    base_path = resolve_model_path(
        config.model.path, config.model.gguf_file, config.model.dtype, config.model.revision
    )  # its tokenizer
    if (directory / "adapter" / "adapter_config.json").is_file():
        from peft import PeftModel

        model = PeftModel.from_pretrained(load_base(base_path, dtype, device), str(directory / "adapter"))
    elif (directory / "model" / "config.json").is_file() or (directory / "config.json").is_file():
        model = load_base(directory / "model" if (directory / "model").is_dir() else directory, dtype, device)
    else:
        raise TrainerError(f"{directory}: neither a checkpoint (adapter/ or model/) nor a model directory")
    tokenizer = load_tokenizer(base_path)
    episodes = episode_runner(config, tokenizer)  # a multi-turn run's environment: its episodes are scored
    fit_context(config, base_path, episodes)
    examples, _ = data.load_examples("val", tokenizer, config.data)
    examples = examples[: config.data.val_size] if config.data.val_size else examples
    settings = HFSettings(str(base_path), dtype, str(device), tokenizer.eos_token_id, tokenizer.pad_token_id,
                          config.rollout.hf.batch_size)  # fmt: skip
    r, reward = config.rollout, scoring.Rewards(config.reward)
    reward.check_answers(examples)

    class Checkpoint:  # the model as an engine of weights version 0
        @threads.busy()
        def generate(self, prompts, sampling):
            return generate_with_hf(model, settings, 0, prompts, sampling, tokenizer)

    sampling = SamplingParams(n, r.temperature, r.top_p, r.max_tokens, config.trainer.seed)
    try:
        model.eval()
        greedy_scores_ = greedy_scores(Checkpoint(), examples, tokenizer, reward, max_tokens=r.max_tokens, version=0,
                                       episodes=episodes)  # fmt: skip
        if episodes is not None:
            played = play_episodes(Checkpoint(), episodes, examples, n, sampling, 0)
            indices = [e.index for e in played]
            sampled_scores = episode_returns(played, reward.score(final_responses(played, tokenizer)))
        else:
            sampled = Checkpoint().generate([list(e.prompt_ids) for e in examples], sampling)
            chosen = [examples[c.prompt_index] for c in sampled]
            indices = [c.prompt_index for c in sampled]
            sampled_scores = [s.total for s in reward.score(responses(chosen, sampled, tokenizer))]
    finally:
        reward.close()
        if episodes is not None:
            episodes.close()
    correct = [0] * len(examples)
    for index, score in zip(indices, sampled_scores, strict=True):
        correct[index] += score >= 1.0
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128, n) if k <= n})
    return {
        "checkpoint": str(directory),
        "prompts": len(examples),
        "greedy_accuracy": float(np.mean([s >= 1.0 for s in greedy_scores_])),
        "greedy_reward": float(np.mean(greedy_scores_)),
        "samples_per_prompt": n,
        "temperature": r.temperature,
        "sampled_reward": float(np.mean(sampled_scores)),
        **{f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in ks},
    }

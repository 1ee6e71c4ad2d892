"""A step's rollouts: prompts drawn, answered by the engine, scored — and DAPO's dynamic sampling, which draws more
prompts until enough groups carry a learning signal. Every completion's weight version is checked, so the trainer
never trains on rollouts of stale weights."""

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

import numpy as np
import torch

from lorarl.trainer import algorithms, data, rewards, scoring
from lorarl.trainer.config import Config
from lorarl.trainer.engines import GREEDY, Completion, EngineError, RolloutEngine, SamplingParams
from lorarl.trainer.envs.episodes import Episode, EpisodeRunner, episode_metrics


@dataclass
class Sample:
    """One response, scored: `score` is the reward function's value, `reward` what advantages see (after shaping)."""

    prompt_ids: list[int]
    completion: Completion
    group: int  # responses to the same prompt (in this step) share it
    score: float
    reward: float
    baseline: float | None = None  # the score of the prompt's greedy response (estimators that ask for one)
    scored: scoring.Score | None = None  # the reward functions' own scores, weighted into `score`
    action_mask: tuple[bool, ...] | None = None  # an episode's: which tokens the engine sampled (None: all)
    episode: int | None = None  # an episode's number in the step, shared by the samples it split into


@dataclass
class Batch:
    """A step's batch on its way (`rollout.max_staleness`): its prompts, drawn, generating on an engine of its own
    from weights `version`; `wait()` gives its completions, or its episodes played to their ends."""

    version: int
    indices: list[int]
    wait: Callable[[], list]
    sampler_state: dict  # the sampler before the batch was drawn: a checkpoint resumes from there


class Rollouts:
    """Draws the training prompts (`sampler`), has `engine` answer them `rollout.n` times, scores the answers."""

    def __init__(self, config: Config, engine: RolloutEngine, examples: list[data.Example],
                 sampler: data.PromptSampler, tokenizer, reward: scoring.Rewards,
                 prefetched: tuple[list[int], list[Completion]] | None = None,
                 episodes: EpisodeRunner | None = None) -> None:  # fmt: skip
        self.config, self.engine, self.examples, self.sampler = config, engine, examples, sampler
        self.tokenizer, self.reward = tokenizer, reward
        self.needs_baseline = algorithms.ADVANTAGES[config.algorithm.adv_estimator].needs_greedy_baseline
        self.prefetched = prefetched  # the next step's batch (rollout.overlap)
        self.episodes = episodes  # multi-turn: the environment's runner (None: single-turn)
        self.played: list[Episode] = []  # this step's episodes, for their metrics
        self.in_flight: dict[int, Batch] = {}  # rollout.max_staleness: the batches of the steps ahead, by step

    def collect(self, step: int, version: int) -> tuple[list[Sample], dict]:
        """Rollouts of a batch of prompts, scored, from weights `version` (or one behind, with overlap). With dynamic
        sampling (DAPO), groups whose rewards all agree are dropped and more prompts are drawn until `data.batch_size`
        groups are kept or `max_sampling_rounds` is reached; then the step trains on what was kept (on the last
        round's samples if nothing was)."""
        a, batch_size = self.config.algorithm, self.config.data.batch_size
        self.reward.at_step(step)
        drawn, kept, groups, self.played = [], [], 0, []
        rounds = a.max_sampling_rounds if a.dynamic_sampling else 1
        for round_ in range(rounds):
            samples = self.generate(step, round_, groups, version)
            groups += len({s.group for s in samples})
            drawn += samples
            if not a.dynamic_sampling:
                kept = samples
                break
            informative = algorithms.informative_groups(torch.tensor([s.reward for s in samples]),
                                                        torch.tensor([s.group for s in samples]))  # fmt: skip
            kept += [s for s, keep in zip(samples, informative.tolist(), strict=True) if keep]
            if len({s.group for s in kept}) >= batch_size:
                break
        metrics = rollout_metrics(drawn) | self.reward.metrics([s.scored for s in drawn if s.scored is not None])
        if self.played:
            metrics |= episode_metrics(self.played)
            metrics["env/hung_threads"] = self.episodes.pool.hung
        if a.dynamic_sampling:
            chosen = set(sorted({s.group for s in kept})[:batch_size])
            kept = [s for s in kept if s.group in chosen] or samples
            metrics.update({"sampling/rounds": round_ + 1, "sampling/prompts": groups,
                            "sampling/kept_groups": len(chosen)})  # fmt: skip
        metrics["rollout/version_lag"] = max(version - s.completion.version for s in kept)
        if self.played:  # an episode's actions may come from several versions (rollout.in_flight_updates)
            lags = [version - v for e in self.played for v in e.versions]
            metrics["rollout/action_version_lag"] = sum(lags) / max(1, len(lags))
        return kept, metrics

    def request(self, step: int, round_: int,
                engine: RolloutEngine | None = None) -> tuple[list[int], Callable[[], list[Completion]]]:  # fmt: skip
        """The next batch of prompts from the sampler, submitted to `engine` (default: the run's): their indices, and
        what waits for the completions."""
        indices, sampling = self._draw(step, round_)
        return indices, (engine or self.engine).submit([self.examples[i].prompt_ids for i in indices], sampling)

    def _draw(self, step: int, round_: int) -> tuple[list[int], SamplingParams]:
        """The next batch of prompts from the sampler (their indices), and how step `step`'s `round_` samples them."""
        seed = step_seed(self.config.trainer.seed, step, round_)
        return self.sampler.next_batch(), sampling_params(self.config.rollout, seed)

    def prefetch(self, step: int) -> Callable[[], None]:
        """`rollout.overlap`: submit step `step`'s batch now (it generates while the trainer trains); the returned
        call waits for it and keeps it for that step."""
        indices, wait = self.request(step, 0)

        def keep() -> None:
            self.prefetched = (indices, wait())

        return keep

    def start(self, step: int, engine: RolloutEngine, version: int, *, newer: bool = False) -> None:
        """`rollout.max_staleness`: draw step `step`'s batch now and have `engine`, which holds weights `version` and
        nothing else to do, generate it beside the training (its episodes play on a thread of their own); `newer`:
        its turns may come from newer weights (`rollout.in_flight_updates`: `engine` checks each reply's)."""
        before = self.sampler.state_dict()
        if self.episodes is None:
            indices, wait = self.request(step, 0, engine)
        else:
            indices, sampling = self._draw(step, 0)
            examples, n = [self.examples[i] for i in indices], self.config.rollout.n
            checked = None if newer else version
            wait = in_background(lambda: play_episodes(engine, self.episodes, examples, n, sampling, checked))
        self.in_flight[step] = Batch(version, indices, wait, before)

    def generate(self, step: int, round_: int, first_group: int, version: int) -> list[Sample]:
        """One batch of prompts, `rollout.n` responses each (generated during the last step with `rollout.overlap`,
        or during the last k with `rollout.max_staleness`), scored (and overlong-shaped)."""
        r, a = self.config.rollout, self.config.algorithm
        batch = self.in_flight.pop(step, None) if round_ == 0 else None
        if self.episodes is not None:
            return self.play(step, round_, first_group, version, batch)
        lag = int(r.overlap)
        if batch is not None:
            indices, completions, version, lag = batch.indices, batch.wait(), batch.version, 0
        elif round_ == 0 and self.prefetched is not None:
            (indices, completions), self.prefetched = self.prefetched, None
        else:
            indices, wait = self.request(step, round_)
            completions = wait()
        check_versions(completions, version, lag=lag)
        examples = [self.examples[i] for i in indices]
        chosen = [examples[c.prompt_index] for c in completions]
        scores = self.reward.score(responses(chosen, completions, self.tokenizer))
        penalties = [0.0] * len(completions)
        if a.overlong_buffer_frac > 0:
            buffer = algorithms.overlong_buffer(a.overlong_buffer_frac, r.max_tokens)
            lengths = torch.tensor([len(c.token_ids) for c in completions])
            penalties = algorithms.overlong_penalty(lengths, r.max_tokens, buffer, a.overlong_penalty).tolist()
        baselines = None
        if self.needs_baseline:
            baselines = greedy_scores(self.engine, examples, self.tokenizer, self.reward, max_tokens=r.max_tokens,
                                      version=version, lag=int(r.overlap))  # fmt: skip
        return [Sample(list(e.prompt_ids), c, first_group + c.prompt_index, score.total, score.total + penalty,
                       None if baselines is None else baselines[c.prompt_index], score)
                for e, c, score, penalty in zip(chosen, completions, scores, penalties, strict=True)]  # fmt: skip

    def play(self, step: int, round_: int, first_group: int, version: int, batch: Batch | None = None) -> list[Sample]:
        """Multi-turn: `rollout.n` episodes per prompt of the next batch (or of `batch`, in flight), played to their
        ends (each on its own, the turns waiting sampled together), scored — the environment's rewards plus the
        reward functions' score of the last action — and turned into samples, one per segment (the episode's return
        on each)."""
        r, a = self.config.rollout, self.config.algorithm
        if batch is not None:
            examples, episodes, version = [self.examples[i] for i in batch.indices], batch.wait(), batch.version
        else:
            indices, sampling = self._draw(step, round_)
            examples = [self.examples[i] for i in indices]
            episodes = play_episodes(self.engine, self.episodes, examples, r.n, sampling, version)
        scores = self.reward.score(final_responses(episodes, self.tokenizer))
        returns = episode_returns(episodes, scores)
        penalties = [0.0] * len(episodes)
        if a.overlong_buffer_frac > 0:
            budget = self.config.env.max_tokens
            buffer = algorithms.overlong_buffer(a.overlong_buffer_frac, budget)
            spent = torch.tensor([e.spent for e in episodes])
            penalties = algorithms.overlong_penalty(spent, budget, buffer, a.overlong_penalty).tolist()
        baselines = None
        if self.needs_baseline:
            baselines = greedy_scores(self.engine, examples, self.tokenizer, self.reward, max_tokens=r.max_tokens,
                                      version=version, episodes=self.episodes)  # fmt: skip
        samples = []
        for number, (episode, score, total, penalty) in enumerate(zip(episodes, scores, returns, penalties,
                                                                      strict=True)):  # fmt: skip
            baseline = None if baselines is None else baselines[episode.index]
            for segment in episode.segments:
                completion = Completion(episode.index, tuple(segment.tokens), tuple(segment.logprobs),
                                        not episode.truncated, min(segment.versions, default=version),
                                        segment.routes)  # fmt: skip
                samples.append(Sample(list(segment.prompt), completion, first_group + episode.index, total,
                                      total + penalty, baseline, score, tuple(segment.mask),
                                      len(self.played) + number))  # fmt: skip
        self.played += episodes
        return samples


def play_episodes(engine: RolloutEngine, runner: EpisodeRunner, examples: list[data.Example], n: int,
                  sampling: SamplingParams, version: int | None, lag: int = 0) -> list[Episode]:  # fmt: skip
    """`n` episodes per example, played on `engine` to their ends, every action checked to come from weights
    `version` (or `lag` before; None: `engine` checks them itself)."""

    def generate(prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        completions = engine.generate(prompts, params)
        if version is not None:
            check_versions(completions, version, lag=lag)
        return completions

    episodes = runner.episodes(examples, n)
    runner.play(generate, episodes, sampling)
    return episodes


def in_background(call: Callable[[], list]) -> Callable[[], list]:
    """`call()` on a daemon thread of its own (one that never returns, an environment's, cannot hold the process at
    exit); what waits for its result (or raises its exception)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as e:  # raised where it is waited for
            future.set_exception(e)

    threading.Thread(target=run, name="lorarl-batch", daemon=True).start()
    return future.result


def final_responses(episodes: list[Episode], tokenizer) -> list[rewards.Response]:
    """What the reward functions see of each episode: its last action, as the response to its data row (and for
    TRL's, the episode's messages: its prompt, and everything after it)."""
    last = [e.actions[-1].tokens if e.actions else () for e in episodes]
    texts = tokenizer.batch_decode([list(t) for t in last], skip_special_tokens=True)
    responses = []
    for e, text, tokens in zip(episodes, texts, last, strict=True):
        prompt, after = e.env.conversation(e.actions) if e.stop_reason != "error" else ([], [])
        responses.append(rewards.Response(e.example.prompt, text, e.example.answer,
                                          {**e.example.columns, **e.env.reward_columns()}, tokens, tuple(after),
                                          tuple(prompt)))  # fmt: skip
    return responses


def episode_returns(episodes: list[Episode], scores: list[scoring.Score]) -> list[float]:
    """Each episode's return: its environment's rewards (each turn's, and its `final_reward`), and the reward
    functions' score of its last action — or, where the environment raised (`env.on_error=score`), `env.error_score`
    alone."""
    return [sum(e.rewards) + (0.0 if e.stop_reason == "error" else e.env.final_reward() + score.total)
            for score, e in zip(scores, episodes, strict=True)]  # fmt: skip


def greedy_scores(engine: RolloutEngine, examples: list[data.Example], tokenizer, reward: scoring.Rewards, *,
                  max_tokens: int, version: int, lag: int = 0,
                  episodes: EpisodeRunner | None = None) -> list[float]:  # fmt: skip
    """The run's reward of the engine's greedy answer to each prompt (with `episodes`, the return of its greedy
    episode), from weights `version` (or `lag` before): validation, and the baseline of ReMax-style estimators."""
    greedy = replace(GREEDY, max_tokens=max_tokens)
    if episodes is not None:
        played = play_episodes(engine, episodes, examples, 1, greedy, version, lag)
        return episode_returns(played, reward.score(final_responses(played, tokenizer)))
    completions = engine.generate([e.prompt_ids for e in examples], greedy)
    check_versions(completions, version, lag=lag)
    return [score.total for score in reward.score(responses(examples, completions, tokenizer))]


def responses(examples: list[data.Example], completions: list[Completion], tokenizer) -> list[rewards.Response]:
    """What the reward functions see of each completion (`examples[i]` answered by `completions[i]`)."""
    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    return [rewards.Response(e.prompt, text, e.answer, e.columns, c.token_ids)
            for e, c, text in zip(examples, completions, texts, strict=True)]  # fmt: skip


def check_versions(completions: list[Completion], version: int, *, lag: int = 0) -> None:
    """Rollouts come from weights `version`, or with `rollout.overlap` (`lag` 1) from at most one update before."""
    allowed = set(range(max(0, version - lag), version + 1))
    stale = {c.version for c in completions} - allowed
    if stale:
        raise EngineError(f"the engine generated with weights version {sorted(stale)}, expected "
                          f"{' or '.join(map(str, sorted(allowed)))}")  # fmt: skip


def rollout_metrics(samples: list[Sample]) -> dict:
    """What the policy does, over every response generated this step (kept by dynamic sampling or not). The reward
    once per episode: an episode split into several samples (a rewritten context) shares its return among them, and
    counts once, as in its group's advantages."""
    episodes = {(s.group, s.episode if s.episode is not None else i): s.score for i, s in enumerate(samples)}
    scores = np.array(list(episodes.values()))
    lengths = np.array([len(s.completion.token_ids) for s in samples])
    metrics = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std(ddof=1)) if scores.size > 1 else 0.0,
        "response_length/mean": float(lengths.mean()),
        "response_length/truncated": float(np.mean([not s.completion.finished for s in samples])),
    }
    penalties = np.array([s.reward - s.score for s in samples])
    if penalties.any():
        metrics["reward/overlong_penalty"] = float(penalties.mean())
    return metrics


def sampling_params(rollout, seed: int) -> SamplingParams:
    """The run's sampling (`rollout.n`, `temperature`, `top_p`, `max_tokens`, `min_tokens`) with `seed`."""
    return SamplingParams(rollout.n, rollout.temperature, rollout.top_p, rollout.max_tokens, seed,
                          min_tokens=rollout.min_tokens)  # fmt: skip


def step_seed(seed: int, step: int, round_: int = 0) -> int:
    """The seed of a step's sampling (and its `round_`-th extra sampling round with dynamic sampling)."""
    return seed * 1_000_003 + step + round_ * 1_000_000_007

"""A batch of episodes played on the rollout engine, each on its own, and what they leave to train on.

Each episode is a coroutine (`scheduling.py`): it asks the engine for its next action, which is sampled together with
the other episodes' waiting then (never one episode at a time), with the episode's own stop strings, what is left of
its token budget (`env.max_tokens`) as its length, and a seed of its episode and turn; then it awaits its
environment's answer, while the other episodes go on. What the episode keeps is its `segments`: a segment is one
training sequence — the context it starts from, then each token after it, sampled (mask 1, with the engine's
log-prob) or appended by the environment (mask 0, log-prob 0). A next observation that does not extend the context
by the action starts a new segment.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from lorarl.trainer.context import DEFAULT_EPISODE_TOKENS
from lorarl.trainer.engines.base import SamplingParams
from lorarl.trainer.envs import ENVIRONMENTS, SINGLE_TURN
from lorarl.trainer.envs.base import Action, Environment, EnvSetup, Observation, Step
from lorarl.trainer.envs.chat import ChatEnvironment, TemplateError, chat_template
from lorarl.trainer.envs.processes import EnvProcesses, RemoteEnvironment
from lorarl.trainer.envs.scheduling import CallTimedOut, EnvPool, HungCalls, TurnBatcher, env_method, event_loop
from lorarl.trainer.envs.tools import load_tools
from lorarl.trainer.errors import TrainerError

TRUNCATIONS = ("length", "budget", "context", "max_turns")  # stop reasons of an episode cut short (not finished)


class EnvError(TrainerError):
    """An environment raised (with `env.on_error=raise`), or answered with something other than the protocol's."""


@dataclass
class Segment:
    """One training sequence of an episode: `prompt`, then `tokens` with their `mask` (sampled) and `logprobs`."""

    prompt: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weights of each action in it
    # the experts of its tokens (`routing`), from its last action's forwards: their prefill read the whole context
    # (the prompt, earlier actions, the environment's tokens), their decode steps the action's tokens
    routes: object = None

    def add(self, tokens, logprobs=None, version: int | None = None, routes=None) -> None:
        """Append sampled `tokens` with the engine's `logprobs`, weight `version` and `routes` (of the context and
        the tokens), or (without) tokens the environment appended."""
        self.tokens += tokens
        self.mask += [logprobs is not None] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)
        if version is not None:
            self.versions.append(version)
            self.routes = None if routes is None else routes[: len(self.prompt) + len(self.tokens) - 1]


@dataclass
class Episode:
    """One episode: its data row (`index` into the batch's examples), environment, context, and record."""

    index: int
    example: object
    env: Environment
    prompt: tuple[int, ...]  # the first observation
    context: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    segments: list[Segment] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # each turn's
    metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""
    timed_turns: int = 0  # actions sampled in a batch made up by timing (`TurnBatcher.sample`)

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    @property
    def truncated(self) -> bool:
        return self.stop_reason in TRUNCATIONS

    @property
    def spent(self) -> int:
        """Tokens after the first observation: what counts against `env.max_tokens`."""
        return len(self.context) - len(self.prompt)

    @property
    def versions(self) -> list[int]:
        """The weights of each action."""
        return [version for segment in self.segments for version in segment.versions]

    @property
    def action_tokens(self) -> int:
        return sum(len(a.tokens) for a in self.actions)

    def count(self, metrics: dict) -> None:
        for key, value in metrics.items():
            self.metrics[key] = self.metrics.get(key, 0.0) + float(value)


class EpisodeRunner:
    """The run's environment (`env.name`), its setup (tools, settings), and the episodes' loop."""

    def __init__(self, section, tokenizer, *, eos: int, system_prompt: str | None = None,
                 max_prompt_tokens: int | None = None, max_context: int | None = None):  # fmt: skip
        self.section, self.tokenizer, self.eos = section, tokenizer, eos
        self.bound(max_prompt_tokens, max_context)
        entry = ENVIRONMENTS[section.name]
        self.environment = entry.environment
        self.setup = EnvSetup(tokenizer, section, entry.settings_in(section), load_tools(section.tools), system_prompt)
        if issubclass(self.environment, ChatEnvironment):  # its template checked now, not at the first episode
            try:
                chat_template(tokenizer, json.dumps([tool.schema for tool in self.setup.tools]))
            except TemplateError as e:
                raise TemplateError(f"env.name={section.name}: {e}") from None
        self.owns_data = self.environment.owns_data  # its reset can make the task (data.train_files=[])
        self.pool = EnvPool(section.concurrency, section.max_hung_calls)
        self.processes = EnvProcesses(section.processes, self.environment, self.setup) if section.processes else None

    def close(self) -> None:
        """Stop the environments' worker processes (`env.processes`)."""
        if self.processes is not None:
            self.processes.close()

    def bound(self, max_prompt_tokens: int | None, max_context: int | None) -> None:
        """The longest first observation (`data.max_prompt_tokens`), and the longest context the engine takes
        (`context.fit_context`, which sets an unset `env.max_tokens` too); None: unbounded."""
        self.max_prompt_tokens, self.max_context = max_prompt_tokens, max_context
        self.max_tokens = self.section.max_tokens or DEFAULT_EPISODE_TOKENS  # an episode's budget

    def episodes(self, examples: list, n: int) -> list[Episode]:
        """`n` episodes per example, not reset yet (`play` resets them)."""
        return [Episode(index, example, self._environment(), ()) for index, example in enumerate(examples)
                for _ in range(n)]  # fmt: skip

    def _environment(self) -> Environment | RemoteEnvironment:
        """A new episode's environment: here, or in a worker process (`env.processes`)."""
        return self.processes.environment_of_episode() if self.processes else self.environment(self.setup)

    def start(self, examples: list, n: int) -> list[Episode]:
        """`n` episodes per example, reset (concurrently)."""
        episodes = self.episodes(examples, n)
        event_loop().run_until_complete(self._gathered(self._reset(e) for e in episodes))
        return episodes

    def play(self, generate: Callable, episodes: list[Episode], sampling: SamplingParams) -> None:
        """Every episode to its end, each on its own: reset (where `start` did not), then turn after turn — its
        action sampled together with the other episodes' waiting for theirs (`generate(contexts, params)`, one
        `SamplingParams` per context: its stop strings, what is left of its budget, a seed of its own episode and
        turn), its environment's answer awaited without holding the others. Then the environment's `conclude` on the
        batch, grouped by data row."""
        event_loop().run_until_complete(self._play(generate, episodes, sampling))
        groups: dict[int, list[Episode]] = {}
        for episode in episodes:
            groups.setdefault(episode.index, []).append(episode)
        self.environment.conclude(list(groups.values()))

    async def _play(self, generate: Callable, episodes: list[Episode], sampling: SamplingParams) -> None:
        batcher = TurnBatcher(generate, len(episodes), self.section.batch_wait_s)
        await self._gathered([batcher.serve()] + [self._episode(batcher, order, episode, sampling)
                                                  for order, episode in enumerate(episodes)])  # fmt: skip

    @staticmethod
    async def _gathered(coroutines) -> None:
        """Every coroutine run concurrently; the first to raise stops the others, and is raised."""
        try:
            async with asyncio.TaskGroup() as group:
                for coroutine in coroutines:
                    group.create_task(coroutine)
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None

    async def _episode(self, batcher: TurnBatcher, order: int, episode: Episode, sampling: SamplingParams) -> None:
        s = self.section
        try:
            if not episode.segments:
                await self._reset(episode)
            turn = 0
            while not episode.done:
                left, room = self.max_tokens - episode.spent, self._room(episode.context)
                if room < 1:  # the context fills the engine's: no token fits after it
                    episode.stop_reason = "context"
                    break
                max_tokens = max(1, min(sampling.max_tokens, left, room))
                params = replace(sampling, n=1, max_tokens=max_tokens, min_tokens=min(sampling.min_tokens, max_tokens),
                                 stop=episode.stop, seed=sampling.seed + 104729 * order + 7919 * turn)  # fmt: skip
                completion, timed = await batcher.sample(order, episode.context, params)
                episode.timed_turns += timed
                await self._act(episode, completion, left, room, last_turn=turn == s.max_turns - 1)
                turn += 1
            if self.processes:
                await self._collected(episode)
        finally:
            batcher.finished()

    async def _collected(self, episode: Episode) -> None:
        """What the rewards read of an ended episode whose environment is in a worker process: fetched now, within
        `env.timeout_s` (where its environment raised, none is read)."""
        try:
            async with asyncio.timeout(self.section.timeout_s or None):
                await episode.env.collect(episode.actions)
        except Exception as e:
            if episode.stop_reason != "error":
                where = episode.example.where or f"prompt {str(episode.example.prompt)[:80]!r}"
                raise EnvError(f"the environment ({self.section.name}) failed to give its final reward, conversation "
                               f"or reward columns on the episode of {where}: {type(e).__name__}: {e}") from e

    async def _reset(self, episode: Episode) -> None:
        observation = await self._guarded(episode, "reset", episode.example)
        if observation is None:  # it raised, and is scored (env.on_error=score)
            return
        observation = self._checked(episode, observation, Observation, "reset")
        if self.max_prompt_tokens is not None and len(observation.tokens) > self.max_prompt_tokens:
            raise EnvError(f"the environment's first observation of {episode.example.where or 'a data row'} holds "
                           f"{len(observation.tokens)} tokens (its tools and template included), more than "
                           f"data.max_prompt_tokens={self.max_prompt_tokens}: raise it")  # fmt: skip
        episode.prompt = episode.context = tuple(observation.tokens)
        episode.stop = tuple(observation.stop)
        episode.segments.append(Segment(episode.prompt))

    def _room(self, context: tuple[int, ...]) -> int:
        """How many tokens the engine can still sample after `context`."""
        return self.max_context - len(context) if self.max_context is not None else 1 << 62

    async def _act(self, episode: Episode, completion, left: int, room: int, *, last_turn: bool) -> None:
        """One action into its episode, and the environment's answer."""
        tokens, logprobs = completion.token_ids[:left], completion.logprobs[:left]
        cut = len(tokens) < len(completion.token_ids)
        finished = completion.finished and not cut
        eos = finished and tokens[-1] == self.eos
        action = Action(tuple(tokens), self.tokenizer.decode(list(tokens)), eos, finished and not eos, tuple(logprobs))
        episode.segments[-1].add(tokens, logprobs, completion.version, completion.routes)
        episode.actions.append(action)
        episode.context = episode.context + action.tokens
        truncation = ("" if finished else "budget" if cut or left <= len(tokens)
                      else "context" if room <= len(tokens) else "length")  # fmt: skip
        if truncation and not episode.env.steps_truncated:
            episode.stop_reason = truncation
            return
        step = await self._guarded(episode, "step", action)
        if step is None:
            return
        step = self._checked(episode, step, Step, "step")
        episode.rewards.append(float(step.reward))
        episode.count(step.metrics)
        if step.done:
            episode.stop_reason = step.stop_reason or "done"
            return
        if truncation in ("budget", "context"):  # stepped, but no room is left for another action
            episode.stop_reason = truncation
            return
        if last_turn:
            episode.stop_reason = "max_turns"
            return
        observation = self._checked(episode, step.observation, Observation, "step's observation")
        following = tuple(observation.tokens)
        if self._room(following) < 1:  # no room left for another action
            episode.stop_reason = "context"
            return
        if len(following) - len(episode.prompt) >= self.max_tokens:
            episode.stop_reason = "budget"
            return
        if following[: len(episode.context)] == episode.context:
            episode.segments[-1].add(following[len(episode.context) :])
        else:  # the environment rewrote the context: what follows trains as a sequence of its own
            episode.segments.append(Segment(following))
        episode.context, episode.stop = following, tuple(observation.stop)

    async def _guarded(self, episode: Episode, what: str, argument):
        """The environment's `what` (reset or step) of `argument`: awaited where it is `async` (or `steps_async`: a
        chat environment with async tools), else on a thread of the pool (`env.concurrency` at once either way), for
        at most `env.timeout_s` from when it starts. If it raises or runs out of time: stop the run naming the row,
        or end the episode with `env.error_score` (`env.on_error=score`; stop reason error or timeout)."""
        try:
            return await self.pool.call(env_method(episode.env, what), argument, self.section.timeout_s or None)
        except HungCalls:  # the run stops, whatever env.on_error says
            raise
        except Exception as e:
            timed_out = isinstance(e, CallTimedOut)
            if self.section.on_error == "raise":
                where = episode.example.where or f"prompt {str(episode.example.prompt)[:80]!r}"
                failure = f"ran out of env.timeout_s={self.section.timeout_s:g} s" if timed_out else "raised"
                detail = "" if timed_out else f": {type(e).__name__}: {e}"
                raise EnvError(f"the environment ({self.section.name}) {failure} in {what} on the episode of "
                               f"{where}{detail} (env.on_error=score scores such episodes instead)") from e  # fmt: skip
            episode.stop_reason = "timeout" if timed_out else "error"
            episode.rewards.append(self.section.error_score)
            episode.count({"timeouts" if timed_out else "errors": 1})
            if not episode.segments:
                episode.segments.append(Segment(tuple(episode.example.prompt_ids)))
            return None

    def _checked(self, episode: Episode, value, expected: type, what: str):
        if not isinstance(value, expected):
            raise EnvError(f"the environment ({self.section.name}) {what} returned {type(value).__name__}, expected "
                           f"{expected.__name__} (lorarl.trainer.envs.base), on the episode of "
                           f"{episode.example.where or 'a data row'}")  # fmt: skip
        return value


def episode_runner(config, tokenizer) -> EpisodeRunner | None:
    """The run's episodes as its configuration (`env`, `data`) describes them (bound by `context.fit_context`: its
    `bound`); None for single-turn."""
    if config.env.name == SINGLE_TURN:
        return None
    return EpisodeRunner(config.env, tokenizer, eos=tokenizer.eos_token_id, system_prompt=config.data.system_prompt,
                         max_prompt_tokens=config.data.max_prompt_tokens)  # fmt: skip


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """What the episodes did: turns, tokens, why they ended, the environments' own counts, each turn's reward."""
    count = len(episodes)
    metrics = {
        "env/failed": sum(e.stop_reason in ("error", "timeout") for e in episodes) / count,
        "env/turns": sum(len(e.actions) for e in episodes) / count,
        "env/timed_turns": sum(e.timed_turns for e in episodes) / max(1, sum(len(e.actions) for e in episodes)),
        "env/action_tokens": sum(e.action_tokens for e in episodes) / count,
        "env/episode_tokens": sum(e.spent for e in episodes) / count,
    }
    for reason in sorted({e.stop_reason for e in episodes}):
        metrics[f"env/stop/{reason}"] = sum(e.stop_reason == reason for e in episodes) / count
    for key in sorted({k for e in episodes for k in e.metrics}):
        metrics[f"env/{key}"] = sum(e.metrics.get(key, 0.0) for e in episodes) / count
    for turn in range(max(len(e.rewards) for e in episodes)):
        rewards = [e.rewards[turn] for e in episodes if len(e.rewards) > turn]
        metrics[f"env/turn_reward/{turn + 1}"] = sum(rewards) / len(rewards)
    if any(len(e.segments) > 1 for e in episodes):
        metrics["env/samples_per_episode"] = sum(len(e.segments) for e in episodes) / count
    return metrics

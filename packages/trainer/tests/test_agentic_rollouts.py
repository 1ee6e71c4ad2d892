"""Episodes at real-world environment latency: environment calls wait concurrently (threads for blocking ones, the
loop for async ones), an episode never waits for another's environment, a call past env.timeout_s ends its episode
(or the run) in one line, and each request samples with its own settings — its stop strings, its length, a stream
of its own seed that the other rows of a batch do not change."""

import asyncio
import itertools
import json
import threading
from dataclasses import replace
from typing import ClassVar

import pytest
import torch
from chat_fixtures import hermes_call, qwen2_style_tokenizer
from test_multiturn import ROW, Script, pieces
from trainer_fixtures import tiny_overrides

from lorarl.trainer import data, default_task
from lorarl.trainer.cli import main
from lorarl.trainer.config import load_config
from lorarl.trainer.context import fit_context
from lorarl.trainer.engines import Completion, SamplingParams
from lorarl.trainer.engines.hf import HFSettings, HFWorker
from lorarl.trainer.envs import ENVIRONMENTS
from lorarl.trainer.envs.base import Environment, Observation, Step
from lorarl.trainer.envs.episodes import EnvError, EpisodeRunner, episode_metrics, episode_runner
from lorarl.trainer.envs.scheduling import HungCalls, event_loop
from lorarl.trainer.models import load_tokenizer
from lorarl.trainer.schema import EnvSection

EPISODES = 6


class Turns(Environment):
    """Three turns of plain text; `answer` (the subclasses') is what each step does before it answers."""

    def reset(self, example) -> Observation:
        return Observation(tuple(self.tokenizer.encode(example.prompt)))

    def answered(self, action) -> Step:
        turns = getattr(self, "turns", 0) + 1
        self.turns = turns
        if turns == 3:
            return Step(reward=1.0, done=True)
        return Step(observation=Observation(tuple(self.tokenizer.encode(ROW.prompt)) + action.tokens))


class AllAtOnce(Turns):
    """Each step waits until every episode is in its step: it passes only if the calls wait concurrently."""

    barrier = threading.Barrier(EPISODES, timeout=20)

    def step(self, action) -> Step:
        self.barrier.wait()
        return self.answered(action)


class AsyncAllAtOnce(Turns):
    """The same, `async`: awaited together on the loop."""

    barrier = None

    async def step(self, action) -> Step:
        await asyncio.wait_for(type(self).barrier.wait(), 20)
        return self.answered(action)


class SlowFirst(Turns):
    """Episode 0's first step waits until every other episode has ended: it passes only if those do not wait for
    episode 0's turn."""

    others_done = threading.Event()
    count = ended = 0
    lock = threading.Lock()

    def reset(self, example) -> Observation:
        with SlowFirst.lock:
            self.number, SlowFirst.count = SlowFirst.count, SlowFirst.count + 1
        return super().reset(example)

    def step(self, action) -> Step:
        if self.number == 0 and not hasattr(self, "turns"):
            assert SlowFirst.others_done.wait(20), "the other episodes waited for episode 0"
        step = self.answered(action)
        if step.done and self.number != 0:
            with SlowFirst.lock:
                SlowFirst.ended += 1
                if SlowFirst.ended == EPISODES - 1:
                    SlowFirst.others_done.set()
        return step


class Counted(Turns):
    """Each step takes 0.05 s and counts the steps going on at once (`most`: the highest count)."""

    lock, running, most = threading.Lock(), 0, 0

    def enter(self) -> None:
        with Counted.lock:
            Counted.running += 1
            Counted.most = max(Counted.most, Counted.running)

    def leave(self) -> None:
        with Counted.lock:
            Counted.running -= 1

    def step(self, action) -> Step:
        self.enter()
        threading.Event().wait(0.05)
        self.leave()
        return self.answered(action)


class AsyncCounted(Counted):
    async def step(self, action) -> Step:
        self.enter()
        await asyncio.sleep(0.05)
        self.leave()
        return self.answered(action)


class Hanging(Turns):
    def step(self, action) -> Step:
        threading.Event().wait(30)  # a service that never answers (its thread is a daemon)
        return self.answered(action)


class OneInSixHangs(Turns):
    """The first episode of each batch (of `EPISODES`) never gets an answer to its first step, until `release` is
    set; the others answer at once."""

    release = threading.Event()
    lock, count = threading.Lock(), 0

    def reset(self, example) -> Observation:
        with OneInSixHangs.lock:
            self.number, OneInSixHangs.count = OneInSixHangs.count, OneInSixHangs.count + 1
        return super().reset(example)

    def step(self, action) -> Step:
        if self.number % EPISODES == 0:
            OneInSixHangs.release.wait()
        return self.answered(action)


class HangsOneInEight(Environment):
    """One turn on the data row's prompt, rewarded by the share of 7s in it; one episode in eight never gets an answer
    to its step (until `release` is set)."""

    release = threading.Event()
    numbers = itertools.count()
    steps_truncated = True  # an action cut at rollout.max_tokens is stepped too

    def reset(self, example) -> Observation:
        self.number = next(HangsOneInEight.numbers)
        return Observation(tuple(example.prompt_ids))

    def step(self, action) -> Step:
        if self.number % 8 == 0:
            HangsOneInEight.release.wait()
        return Step(reward=action.text.count("7") / max(1, len(action.text)), done=True)


class Instant(Turns):
    """Each step answers at once, on the thread that runs it (recorded)."""

    threads: ClassVar[set] = set()

    def step(self, action) -> Step:
        Instant.threads.add(threading.get_ident())
        return self.answered(action)


class Answers:
    """The engine's side: the same action for every context it is given; each call's contexts recorded."""

    def __init__(self, tokenizer):
        self.ids = (*tokenizer.encode(" more"), tokenizer.eos_token_id)
        self.calls: list[int] = []

    def __call__(self, prompts, sampling: list[SamplingParams]) -> list[Completion]:
        assert len(sampling) == len(prompts)
        self.calls.append(len(prompts))
        return [Completion(i, self.ids, (-0.5,) * len(self.ids), True, 0) for i in range(len(prompts))]


def play(name: str, env_class, *, batches: int = 1, episodes: int = EPISODES, **settings):
    """`batches` batches of `episodes` episodes played one after another by one runner: the last batch's episodes,
    the engine, and the runner."""
    tok = qwen2_style_tokenizer()
    ENVIRONMENTS.register(name)(env_class)
    try:
        run = EpisodeRunner(EnvSection(name=name, **settings), tok, eos=tok.eos_token_id)
        for _ in range(batches):
            played = run.episodes([ROW], episodes)
            engine = Answers(tok)
            run.play(engine, played, SamplingParams(max_tokens=8))
        return played, engine, run
    finally:
        ENVIRONMENTS.remove(name)


def test_blocking_environment_calls_wait_concurrently():
    episodes, engine, _ = play("all_at_once", AllAtOnce)
    assert [e.stop_reason for e in episodes] == ["done"] * EPISODES
    assert engine.calls == [EPISODES] * 3  # every episode's turn in one engine call
    assert episode_metrics(episodes)["env/timed_turns"] == 0  # each batch went once every episode waited


def test_async_environment_calls_are_awaited_together():
    AsyncAllAtOnce.barrier = None

    async def make_barrier():
        return asyncio.Barrier(EPISODES)

    AsyncAllAtOnce.barrier = event_loop().run_until_complete(make_barrier())
    episodes, _, _ = play("async_all_at_once", AsyncAllAtOnce)
    assert [sum(e.rewards) for e in episodes] == [1.0] * EPISODES


def test_an_episode_does_not_wait_for_another_episodes_environment():
    SlowFirst.count, SlowFirst.ended = 0, 0
    SlowFirst.others_done.clear()
    episodes, engine, _ = play("slow_first", SlowFirst, batch_wait_s=0.01)
    assert [e.stop_reason for e in episodes] == ["done"] * EPISODES
    assert len(engine.calls) > 3  # the others' turns went on while episode 0 waited: more, smaller engine calls
    assert episode_metrics(episodes)["env/timed_turns"] > 0  # those batches' make-up was timing's, and is counted


@pytest.mark.parametrize("env_class", [Counted, AsyncCounted])
@pytest.mark.parametrize("concurrency", [2, EPISODES])
def test_no_more_environment_calls_go_on_at_once_than_env_concurrency(env_class, concurrency):
    Counted.most = 0
    episodes, _, _ = play("counted", env_class, concurrency=concurrency)
    assert [e.stop_reason for e in episodes] == ["done"] * EPISODES
    assert Counted.most == concurrency  # reached, never passed


def test_a_call_past_the_timeout_ends_its_episode_scored_or_stops_the_run_in_one_line():
    episodes, _, _ = play("hanging", Hanging, timeout_s=0.2, on_error="score", error_score=-1.0)
    assert {e.stop_reason for e in episodes} == {"timeout"}
    assert [e.rewards for e in episodes] == [[-1.0]] * EPISODES
    assert episode_metrics(episodes)["env/timeouts"] == 1.0
    with pytest.raises(EnvError, match=r"^the environment \(hanging\) ran out of env.timeout_s=0.2 s in step on the "
                                       r"episode of train.jsonl line 3 \(env.on_error=score"):  # fmt: skip
        play("hanging", Hanging, timeout_s=0.2)


def test_calls_that_never_return_leave_their_threads_and_the_others_are_served_to_the_bound():
    """One episode in six hangs in every batch, at env.concurrency=2: each batch still times out only that one (its
    thread leaves the pool, another serves the queue), until env.max_hung_calls threads are left: then the run stops
    in one line, whatever env.on_error says."""
    OneInSixHangs.count = 0
    OneInSixHangs.release.clear()
    try:
        settings = {"concurrency": 2, "timeout_s": 0.3, "on_error": "score", "max_hung_calls": 6}
        for batches in (1, 5):
            OneInSixHangs.count = 0
            episodes, _, run = play("one_in_six_hangs", OneInSixHangs, batches=batches, **settings)
            assert sorted(e.stop_reason for e in episodes) == ["done"] * (EPISODES - 1) + ["timeout"]
            assert episode_metrics(episodes)["env/timeouts"] == 1 / EPISODES
            assert run.pool.hung == batches
            assert run.pool.threads <= settings["concurrency"]
        OneInSixHangs.count = 0
        with pytest.raises(HungCalls, match=r"^6 blocking environment calls were given up on at env.timeout_s and "
                                            r"never returned, each holding a thread \(env.max_hung_calls=6\)"):
            play("one_in_six_hangs", OneInSixHangs, batches=7, **settings)
    finally:
        OneInSixHangs.release.set()  # the threads left to them end


def test_a_run_whose_environment_hangs_on_one_episode_in_eight_keeps_learning(tiny_setup, tmp_path, capsys):
    """At env.concurrency=4, 32 episodes a step, 4 of which never return: every step times out those 4 alone (the
    threads left to them are replaced), learns from the rest, and says once that threads were left."""
    out = tmp_path / "out"
    HangsOneInEight.release.clear()
    ENVIRONMENTS.register("hangs_one_in_eight")(HangsOneInEight)
    try:
        assert main(tiny_overrides(tiny_setup, out, env__name="hangs_one_in_eight", env__concurrency=4,
                                   env__timeout_s=0.3, env__on_error="score", trainer__steps=6)) == 0  # fmt: skip
    finally:
        HangsOneInEight.release.set()
        ENVIRONMENTS.remove("hangs_one_in_eight")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["env/timeouts"] for s in steps] == [0.125] * 6
    assert [s["env/hung_threads"] for s in steps] == [4, 8, 12, 16, 20, 24]
    assert all(s["grad_norm"] > 0 for s in steps)
    assert capsys.readouterr().out.count("ran past env.timeout_s and never returned") == 1


def test_calls_that_answer_at_once_are_served_by_a_thread_or_a_few():
    """One thread on a quiet machine; where other work takes the cores, a thread descheduled for longer than the
    pool's look (5 ms) makes it start another or two, never one per call (256 threads, before)."""
    Instant.threads = set()
    episodes, _, run = play("instant", Instant, episodes=256)
    assert [e.stop_reason for e in episodes] == ["done"] * 256
    assert len(Instant.threads) <= run.pool.threads <= 4


def test_each_request_samples_with_its_own_stop_length_and_seed_on_the_hf_engine():
    model = default_task.EMBEDDED["calculator"]
    tok = load_tokenizer(model)
    hf = HFWorker(HFSettings(str(model), torch.float32, "cpu", tok.eos_token_id, tok.pad_token_id, 64))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"] for q in ("123*45", "7*8", "350*99")]  # fmt: skip
    each = [SamplingParams(max_tokens=12, temperature=1.5, seed=seed) for seed in (11, 12, 13)]
    sampled = hf.generate(prompts, each)
    # a request's samples are those of its seed, whatever else decodes beside it (alone, or with other prompts)
    assert hf.generate([prompts[1]], [each[1]])[0].token_ids == sampled[1].token_ids
    assert hf.generate([prompts[2], prompts[1]], [each[2], each[1]])[1].token_ids == sampled[1].token_ids
    assert hf.generate(prompts, each) == sampled  # and the same seeds, the same samples
    # its own stop strings and length: a row of one request is not cut by another's
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    mixed = hf.generate(prompts, [replace(greedy, stop=("</call>",)), replace(greedy, max_tokens=3), greedy])
    whole = hf.generate(prompts, greedy)
    call = tok.decode(list(mixed[0].token_ids))
    assert "</call>" not in call or call.endswith("</call>")
    assert mixed[1].token_ids == whole[1].token_ids[:3]
    assert not mixed[1].finished
    assert mixed[2].token_ids == whole[2].token_ids


def calculator_episodes(generate, max_context: int | None, *, rows: int = 16, n: int = 2):
    """The calculator task's episodes of its first `rows` rows, `n` each, played on `generate` with contexts of at
    most `max_context` tokens (None: the model's positions)."""
    config = load_config(None, ["task=calculator"])
    model = default_task.EMBEDDED["calculator"]
    tok = load_tokenizer(model)
    runner = episode_runner(config, tok)
    positions = fit_context(config, model, runner)
    runner.bound(config.data.max_prompt_tokens, max_context or positions)
    examples, _ = data.load_examples("train", tok, config.data)
    episodes = runner.episodes(examples[:rows], n)
    runner.play(generate, episodes, SamplingParams(max_tokens=12, temperature=1.0, seed=5))
    return episodes


@pytest.mark.parametrize("limit", [14, 20])  # an action cut (14); an observation that would not fit (20)
def test_an_episode_that_outgrows_the_engines_context_ends_with_stop_reason_context_on_the_hf_engine(limit):
    """Each episode cut by a shorter context is the same episode played on the model's 64 positions, up to the cut:
    its context a prefix, its actions and rewards those before it — ended as `budget` ends one (truncated)."""
    model = default_task.EMBEDDED["calculator"]
    tok = load_tokenizer(model)
    hf = HFWorker(HFSettings(str(model), torch.float32, "cpu", tok.eos_token_id, tok.pad_token_id, 64))
    free, cut = calculator_episodes(hf.generate, None), calculator_episodes(hf.generate, limit)
    whole_last_actions = set()  # of the episodes cut: whether the last action was whole (an observation did not fit)
    for whole, short in zip(free, cut, strict=True):
        assert len(short.context) <= limit
        assert all(len(s.prompt) + len(s.tokens) <= limit for s in short.segments)
        if len(whole.context) <= limit:
            assert (short.context, short.stop_reason) == (whole.context, whole.stop_reason)
            continue
        assert short.stop_reason == "context"
        assert short.truncated
        assert short.context == whole.context[: len(short.context)]
        assert short.rewards == whole.rewards[: len(short.rewards)]
        assert [a.tokens for a in short.actions[:-1]] == [a.tokens for a in whole.actions[: len(short.actions) - 1]]
        whole_last_actions.add(short.actions[-1].tokens == whole.actions[len(short.actions) - 1].tokens)
    assert 0 < episode_metrics(cut)["env/stop/context"] < 1
    assert whole_last_actions == {limit == 20}


RENDEZVOUS: list = []  # the barrier every episode's tool call waits at, made on the episodes' loop


async def rendezvous(a: int, b: int) -> int:
    """Add two integers once every episode's call has come.

    Args:
        a: the first integer
        b: the second integer
    """
    assert asyncio.get_running_loop() is event_loop()  # the episodes' loop, not a loop of its own in a thread
    await asyncio.wait_for(RENDEZVOUS[0].wait(), 20)
    return a + b


def test_async_tools_are_awaited_together_on_the_episodes_loop():
    """Each episode's `async def` tool call waits until every episode's has come: it passes only if they are awaited
    concurrently, on the loop the episodes run on (a client bound to that loop works in them)."""

    async def barrier():
        return asyncio.Barrier(EPISODES)

    RENDEZVOUS[:] = [event_loop().run_until_complete(barrier())]
    tok = qwen2_style_tokenizer()
    run = EpisodeRunner(EnvSection(name="tools", tools=[f"{__name__}:rendezvous"]), tok, eos=tok.eos_token_id)
    episodes = run.start([ROW], EPISODES)
    call = pieces(hermes_call("rendezvous", {"a": 12, "b": 7}), tok)
    run.play(Script(tok, [[call, [*pieces("19", tok), "<|im_end|>"]]] * EPISODES), episodes,
             SamplingParams(max_tokens=64))  # fmt: skip
    assert [e.stop_reason for e in episodes] == ["answer"] * EPISODES
    assert all(e.metrics == {"tool_calls": 1, "tool_errors": 0} for e in episodes)
    assert all(e.env.messages[2]["content"] == "19" for e in episodes)  # the tool's answer, as a sync tool's

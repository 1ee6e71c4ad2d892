"""What lets a batch's episodes run on their own: one event loop, environment calls that wait concurrently, and the
engine fed with the turns that are waiting.

Real environments are services (a sandbox, a search API, a judge: 0.1–10 s a call). An episode is a coroutine on its
thread's loop (`event_loop`). A plain (blocking) environment call runs on one of `env.concurrency` daemon threads
(`EnvPool`, started as calls wait; daemon, so that a call that never returns cannot hold the process at exit); an
`async` one is awaited on the loop; either is bounded by `env.timeout_s`. The engine takes the turns waiting
(`TurnBatcher`) as one request: as soon as no episode is in an environment call — what keeps instant environments'
batches the lockstep ones — or once the first of them has waited `env.batch_wait_s`. It generates on the loop's
thread, while the blocking environment calls go on in theirs.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Callable, Sequence

from lorarl.trainer.engines.base import Completion, SamplingParams

_loops = threading.local()


def event_loop() -> asyncio.AbstractEventLoop:
    """The loop a batch's episodes run on: one per thread (batches in flight beside the training,
    `rollout.max_staleness`, each play on a thread of their own), kept, as episodes' async clients may hold on to it."""
    if getattr(_loops, "loop", None) is None:
        _loops.loop = asyncio.new_event_loop()
    return _loops.loop


def env_method(env, what: str) -> Callable:
    """An environment's `what` (reset or step) as it is called: a chat environment's step through `astep` where its
    tools are async (`steps_async`: awaited on the episodes' loop)."""
    return env.astep if what == "step" and getattr(env, "steps_async", False) else getattr(env, what)


class EnvPool:
    """At most `size` environment calls at once (`env.concurrency`): blocking ones on up to `size` daemon threads,
    async ones awaited, `size` at a time on each loop. Threads start as calls wait for one: the first at once, more
    once a call has waited `GROW_AFTER_S` (calls that answer at once are served by a few threads, which do not contend
    for the interpreter; slow ones get a thread each, up to `size`)."""

    GROW_AFTER_S = 0.005

    def __init__(self, size: int):
        self.size, self.calls, self.threads, self.idle = size, queue.SimpleQueue(), 0, 0
        self.lock = threading.Lock()
        self.limits: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    async def call(self, method: Callable, argument):
        """`method(argument)`: awaited where it is `async`, else on one of the threads."""
        if not inspect.iscoroutinefunction(method):
            return await self.run(lambda: method(argument))
        loop = asyncio.get_running_loop()
        with self.lock:
            limit = self.limits.setdefault(loop, asyncio.Semaphore(self.size))
        async with limit:
            return await method(argument)

    async def run(self, call: Callable[[], object]):
        """`call()` on one of the threads, awaited on the running loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.calls.put((call, loop, future))
        with self.lock:
            if self.threads == 0:
                self._start(1)
            elif self.calls.qsize() > self.idle:
                loop.call_later(self.GROW_AFTER_S, self._grow)
        return await future

    def _grow(self) -> None:
        """A thread for each call still waiting, up to `size` in all."""
        with self.lock:
            self._start(min(self.calls.qsize() - self.idle, self.size - self.threads))

    def _start(self, count: int) -> None:
        for _ in range(max(0, count)):
            self.threads += 1
            threading.Thread(target=self._serve, name="lorarl-env", daemon=True).start()

    def _serve(self) -> None:
        while True:
            with self.lock:
                self.idle += 1
            call, loop, future = self.calls.get()
            with self.lock:
                self.idle -= 1
            try:
                result, error = call(), None
            except BaseException as e:  # handed to the episode whose call it was
                result, error = None, e
            loop.call_soon_threadsafe(settle, future, result, error)


def settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # its episode gave up on it (env.timeout_s)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class TurnBatcher:
    """The engine's side of a batch of episodes: each episode asks for its next action (`sample`), and the waiting
    requests go to `generate(contexts, params)` together, in the episodes' order, one request at a time."""

    def __init__(self, generate: Callable[[list[list[int]], list[SamplingParams]], list[Completion]], episodes: int,
                 wait_s: float):  # fmt: skip
        self.generate, self.running, self.wait_s = generate, episodes, wait_s
        self.waiting: dict[int, tuple[list[int], SamplingParams, asyncio.Future]] = {}
        self.first_wait = 0.0  # when the oldest waiting request came
        self.changed = asyncio.Event()

    async def sample(self, order: int, context: Sequence[int], params: SamplingParams) -> Completion:
        """Episode `order`'s next action: a completion of `context` sampled with `params`."""
        future = asyncio.get_running_loop().create_future()
        if not self.waiting:
            self.first_wait = time.monotonic()
        self.waiting[order] = (list(context), params, future)
        self.running -= 1  # until the engine has answered it
        self.changed.set()
        return await future

    def finished(self) -> None:
        """An episode has ended: the engine no longer waits for it."""
        self.running -= 1
        self.changed.set()

    async def serve(self) -> None:
        """Send waiting requests to the engine until every episode has ended."""
        while True:
            while not self._due():
                if not self.waiting and self.running <= 0:
                    return
                self.changed.clear()
                timeout = None if not self.waiting else max(0.0, self.first_wait + self.wait_s - time.monotonic())
                try:
                    await asyncio.wait_for(self.changed.wait(), timeout)
                except TimeoutError:
                    break
            orders = sorted(self.waiting)
            taken = [self.waiting.pop(order) for order in orders]
            self.running += len(taken)  # answered (below) or failed, each goes on
            try:  # on the loop's thread: torch's work stays on the thread that owns it (a thread of its own measured
                # 1.4x the rollout of the calculator task); blocking environment calls go on meanwhile
                completions = self.generate([t[0] for t in taken], [t[1] for t in taken])
            except Exception as error:  # each waiting episode raises it
                for _, _, future in taken:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, _, future), completion in zip(taken, completions, strict=True):
                if not future.done():
                    future.set_result(completion)

    def _due(self) -> bool:
        """Whether the waiting requests go now: no episode is in an environment call, or the first has waited long
        enough."""
        if not self.waiting:
            return False
        return self.running <= 0 or time.monotonic() >= self.first_wait + self.wait_s

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
import contextlib
import inspect
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lorarl.trainer.engines.base import Completion, SamplingParams
from lorarl.trainer.errors import TrainerError

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


class CallTimedOut(TimeoutError):
    """An environment call ran past its time limit (`env.timeout_s`), counted from when it started: time spent waiting
    for its turn (`env.concurrency`) is not its own."""


class HungCalls(TrainerError):
    """More blocking environment calls than a run may leave running (`env.max_hung_calls`) were given up on and never
    returned: the run stops (whatever `env.on_error` says)."""


@dataclass(eq=False)
class _Job:
    """A blocking call, queued for a thread of the pool."""

    call: Callable[[], object]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    started: float | None = None  # when a thread took it
    given_up: bool = False  # its episode stopped waiting for it (env.timeout_s)


class EnvPool:
    """At most `size` environment calls at once (`env.concurrency`): blocking ones on up to `size` daemon threads,
    async ones awaited, `size` at a time on each loop.

    Threads start as calls need them: the first at once; more only while calls wait and none has ended for
    `GROW_AFTER_S` (every thread is held by a call that takes its time), twice as many each time, up to `size` — so
    calls that answer at once are served by one thread (no contention for the interpreter), and slow ones soon get a
    thread each. A call given up on (`env.timeout_s`) no longer
    holds its place: one not started is skipped; one still running keeps its thread, which leaves the pool (another
    serves the queue in its stead) and ends if the call ever returns. Such threads are leaked (`hung` counts them: the
    trainer logs it as env/hung_threads, and says so once): at most `max_hung` at once (`env.max_hung_calls`), then
    every call raises `HungCalls`."""

    GROW_AFTER_S = 0.005

    def __init__(self, size: int, max_hung: int = 1024):
        self.size, self.max_hung = size, max_hung
        self.calls: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.threads = 0  # serving the queue (those left to a call given up on are not counted)
        self.idle = 0
        self.running: set[_Job] = set()
        self.hung = 0  # threads left to calls given up on, still in them
        self.growing: set[asyncio.AbstractEventLoop] = set()  # the loops a look at starting threads is due on
        self.ended = self.ended_at_look = 0  # calls ended, and how many had at the last look
        self.lock = threading.Lock()
        self.limits: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    async def call(self, method: Callable, argument, timeout: float | None = None):
        """`method(argument)`: awaited where it is `async`, else on one of the threads; `CallTimedOut` once it has
        run `timeout` seconds (None: no limit)."""
        if not inspect.iscoroutinefunction(method):
            return await self.run(lambda: method(argument), timeout)
        loop = asyncio.get_running_loop()
        with self.lock:
            limit = self.limits.setdefault(loop, asyncio.Semaphore(self.size))
        async with limit:
            try:
                async with asyncio.timeout(timeout) as deadline:
                    return await method(argument)
            except TimeoutError:
                if deadline.expired():
                    raise CallTimedOut from None
                raise

    async def run(self, call: Callable[[], object], timeout: float | None = None):
        """`call()` on one of the threads, awaited on the running loop; `CallTimedOut` once it has run `timeout`
        seconds (None: no limit)."""
        if self.hung >= self.max_hung:
            raise HungCalls(f"{self.hung} blocking environment calls were given up on at env.timeout_s and never "
                            f"returned, each holding a thread (env.max_hung_calls={self.max_hung}): the environment "
                            "hangs; make its calls return, or end them itself within a time limit")  # fmt: skip
        loop = asyncio.get_running_loop()
        job = _Job(call, loop, loop.create_future())
        self.calls.put(job)
        with self.lock:
            if self.threads == 0:
                self._start(1)
            elif self.calls.qsize() > self.idle and loop not in self.growing:
                self.growing.add(loop)  # one look at a time on a loop, not one per call
                loop.call_later(self.GROW_AFTER_S, self._grow, loop)
        try:
            if timeout is None:
                return await job.future
            while True:  # until `timeout` after the thread took it: the first wait counts from now
                end = (job.started or time.monotonic()) + timeout
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(end - time.monotonic() + loop.time()):
                        return await asyncio.shield(job.future)
                if job.started is not None and time.monotonic() >= job.started + timeout:
                    raise CallTimedOut
        except (asyncio.CancelledError, CallTimedOut):
            self._give_up(job)
            raise

    def _grow(self, loop: asyncio.AbstractEventLoop) -> None:
        """While calls wait and none has ended since the last look (`GROW_AFTER_S` ago): twice the threads, at most a
        thread per call waiting and `size` in all; looked at again after `GROW_AFTER_S` while calls still wait."""
        with self.lock:
            self.growing.discard(loop)
            waiting = self.calls.qsize() - self.idle
            if waiting <= 0:
                return
            if self.ended == self.ended_at_look:
                self._start(min(waiting, self.size - self.threads, max(1, self.threads)))
            self.ended_at_look = self.ended
            if self.threads < self.size:
                self.growing.add(loop)
                loop.call_later(self.GROW_AFTER_S, self._grow, loop)

    def _start(self, count: int) -> None:
        for _ in range(max(0, count)):
            self.threads += 1
            threading.Thread(target=self._serve, name="lorarl-env", daemon=True).start()

    def _give_up(self, job: _Job) -> None:
        """Its episode no longer waits for `job`: skipped if not started; if running, its thread leaves the pool."""
        with self.lock:
            job.given_up = True
            if job not in self.running:
                return
            self.threads -= 1
            self.hung += 1
            if self.calls.qsize() > self.idle:
                self._start(1)

    def _serve(self) -> None:
        while True:
            with self.lock:
                self.idle += 1
            job = self.calls.get()
            with self.lock:
                self.idle -= 1
                if job.given_up:  # its episode stopped waiting before it started
                    continue
                job.started = time.monotonic()
                self.running.add(job)
            try:
                result, error = job.call(), None
            except BaseException as e:  # handed to the episode whose call it was
                result, error = None, e
            with self.lock:
                self.running.discard(job)
                self.ended += 1
                if job.given_up:  # this thread left the pool when its call was given up on
                    self.hung -= 1
                    return
            job.loop.call_soon_threadsafe(settle, job.future, result, error)


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

    async def sample(self, order: int, context: Sequence[int], params: SamplingParams) -> tuple[Completion, bool]:
        """Episode `order`'s next action: a completion of `context` sampled with `params`; and whether its batch went
        while other episodes were still in environment calls (`env.batch_wait_s` ran out): that batch's make-up, and
        so its rows' rounding in bf16, depended on timing."""
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
            timed = self.running > 0  # episodes still in environment calls: this batch's make-up is timing's
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
                    future.set_result((completion, timed))

    def _due(self) -> bool:
        """Whether the waiting requests go now: no episode is in an environment call, or the first has waited long
        enough."""
        if not self.waiting:
            return False
        return self.running <= 0 or time.monotonic() >= self.first_wait + self.wait_s

"""Environments in worker processes (`env.processes=N`): for CPU-heavy environments (a code checker, a simulator,
a parser), whose steps would hold the interpreter the trainer, the engine and the other episodes share.

Each episode's environment lives in one of N spawned workers (its instance made there at `reset`, so its state stays
where its calls run); the trainer holds a `RemoteEnvironment` that forwards `reset` and `step` and, once the episode
has ended, collects what the rewards read of it (`final_reward`, `conversation`, `reward_columns`) in one call. A worker
serves its episodes' calls as the trainer's process does (`scheduling`: blocking ones on threads, async ones on its
loop), so one slow call holds up only its own episode; calls of different workers run in parallel. A worker that dies
fails the calls of the episodes it held, each under `env.on_error`; the next episodes get a new one.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import pickle
import threading
from dataclasses import fields
from types import SimpleNamespace

from lorarl.trainer.envs.base import Environment, EnvSetup
from lorarl.trainer.envs.scheduling import EnvPool, env_method, settle
from lorarl.trainer.errors import TrainerError


class WorkerDied(TrainerError):
    """The worker process holding an episode's environment exited."""


class RemoteEnvironment:
    """An episode's environment in a worker process, as the episode runner sees it."""

    steps_async = False  # the worker decides how its environment's step runs

    def __init__(self, worker: Worker, key: int, environment: type):
        self.worker, self.key = worker, key
        self.steps_truncated = environment.steps_truncated
        self.collected: tuple = (0.0, ([], []), {})

    async def reset(self, example):
        return await self.worker.call(self.key, "reset", example)

    async def step(self, action):
        return await self.worker.call(self.key, "step", action)

    async def collect(self, actions: list) -> None:
        """What the rewards read of the ended episode (and its instance dropped in the worker)."""
        self.collected = await self.worker.call(self.key, "collect", actions)

    def final_reward(self) -> float:
        return self.collected[0]

    def conversation(self, actions: list) -> tuple[list[dict], list[dict]]:
        return self.collected[1]

    def reward_columns(self) -> dict:
        return self.collected[2]


class Worker:
    """One spawned process and the calls waiting on it."""

    START_TIMEOUT_S = 300.0

    def __init__(self, context, arguments: tuple):
        self.connection, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, *arguments), name="lorarl-env-worker", daemon=True)
        self.process.start()
        child.close()
        self.pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.ids, self.lock, self.died = itertools.count(), threading.Lock(), None
        self.started, self.load_error = threading.Event(), ""
        threading.Thread(target=self._read, name="lorarl-env-reader", daemon=True).start()

    def wait_started(self) -> str:
        """Once its environment has loaded: "" , or why it did not."""
        if not self.started.wait(self.START_TIMEOUT_S):
            return f"it did not start within {self.START_TIMEOUT_S:g} s"
        return self.load_error

    async def call(self, key: int, what: str, argument):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.lock:
            if self.died is not None:
                raise self.died
            request = next(self.ids)
            self.pending[request] = (loop, future)
            self.connection.send((request, key, what, argument))
        return await future

    def _read(self) -> None:
        try:
            self.load_error = self.connection.recv()  # its first message: "" once loaded, or why it was not
            self.started.set()
            while True:
                request, result, error = self.connection.recv()
                with self.lock:
                    loop, future = self.pending.pop(request)
                loop.call_soon_threadsafe(settle, future, result, error)
        except (EOFError, OSError):
            pass
        self.process.join()
        if not self.started.is_set():
            self.load_error = (f"it exited (exit code {self.process.exitcode}) while loading (each worker imports the "
                               "script that started the run again: a script needs if __name__ == '__main__':)")
            self.started.set()
        failed = WorkerDied(f"the env.processes worker holding this episode's environment exited "
                            f"(exit code {self.process.exitcode})")  # fmt: skip
        with self.lock:
            self.died, waiting = failed, list(self.pending.values())
            self.pending.clear()
        for loop, future in waiting:
            loop.call_soon_threadsafe(settle, future, None, failed)

    def close(self) -> None:
        self.process.kill()
        self.process.join()
        self.connection.close()


class EnvProcesses:
    """`count` workers, started at once (each imports the environment and the tokenizer: seconds); episodes are
    dealt to them in turn."""

    def __init__(self, count: int, environment: type, setup):
        section = setup.section
        if environment.conclude.__func__ is not Environment.conclude.__func__:
            raise TrainerError(f"env.processes={count}: env.name={section.name} concludes its batches in the "
                               "trainer's process (Environment.conclude), which a worker cannot: set "
                               "env.processes=0")  # fmt: skip
        self.environment, self.spec = environment, section.name
        section = SimpleNamespace(**{f.name: getattr(section, f.name) for f in fields(section)})  # its class is
        # made with the run's plugins' settings (config.py), which a worker cannot import
        self.arguments = (_reference(environment), section.name,
                          (section, setup.tokenizer, setup.settings, setup.system_prompt,
                           [tool.schema for tool in setup.tools]))  # fmt: skip
        self.context = multiprocessing.get_context("spawn")  # never fork a process holding torch's threads
        self.workers = [self._started() for _ in range(count)]
        self.keys = itertools.count()

    def _started(self) -> Worker:
        return Worker(self.context, self.arguments)

    def environment_of_episode(self) -> RemoteEnvironment:
        """A new episode's environment, on the next worker (a new one where it has exited)."""
        key = next(self.keys)
        index = key % len(self.workers)
        if self.workers[index].died is not None:
            self.workers[index] = self._started()
        failed = self.workers[index].wait_started()
        if failed:
            raise TrainerError(f"env.processes: a worker could not load env.name={self.spec}: {failed}")
        return RemoteEnvironment(self.workers[index], key, self.environment)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


def _reference(environment: type) -> bytes | None:
    """The class pickled by reference (its module imported in the worker registers it), or None."""
    try:
        return pickle.dumps(environment)
    except Exception:
        return None


def serve(connection, environment: bytes | None, spec: str, setup: tuple) -> None:
    """A worker's life: the environment's class (by reference, or where that does not load here, as the registry
    finds `spec`), then each request (reset, step, collect) served as it comes, until the trainer's end of the pipe
    closes."""
    from lorarl.trainer.envs import ENVIRONMENTS
    from lorarl.trainer.envs.tools import load_tools

    try:
        try:
            environment = pickle.loads(environment)
        except Exception:  # a class of a file named by path (env.name=path/to/file.py:Cls), or made at run time
            environment = ENVIRONMENTS[spec].environment
        section, tokenizer, settings, system_prompt, schemas = setup
        setup = EnvSetup(tokenizer, section, settings, load_tools(section.tools, schemas), system_prompt)
    except Exception as e:
        connection.send(f"{type(e).__name__}: {e}")
        return
    connection.send("")
    loop, instances, lock = asyncio.new_event_loop(), {}, threading.Lock()
    pool = EnvPool(section.concurrency, section.max_hung_calls)

    async def answer(request: int, key: int, what: str, argument) -> None:
        try:
            if what == "reset":
                instances[key] = environment(setup)
            env = instances[key]
            limit = section.timeout_s or None  # given up on here too: a hung call's thread is let go
            if what == "collect":
                del instances[key]
                result = await pool.run(lambda: (float(env.final_reward()), env.conversation(argument),
                                                 env.reward_columns()), limit)  # fmt: skip
            else:
                result = await pool.call(env_method(env, what), argument, limit)
            reply = pickle.dumps((request, result, None))
        except BaseException as e:  # the episode's, raised where it waits
            reply = pickle.dumps((request, None, _portable(e)))
        with lock:
            connection.send_bytes(reply)

    def read() -> None:
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                loop.call_soon_threadsafe(loop.stop)
                return
            loop.call_soon_threadsafe(loop.create_task, answer(*message))

    threading.Thread(target=read, daemon=True).start()
    loop.run_forever()


def _portable(error: BaseException) -> BaseException:
    """`error`, or (one that does not pickle) its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")

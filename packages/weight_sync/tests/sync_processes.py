"""Run functions in separate processes joined by a real gloo sync group on 127.0.0.1, bounded in time."""

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable

from lorarl.weight_sync import create_sync_group, free_port

# A fork server that has imported torch once starts each test process in a fraction of a second, where spawn imports
# torch again in each (~2 s of CPU: most of these tests' time). It forks before any thread or device exists.
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "lorarl.weight_sync"])


def _child(fn: Callable, rank: int, world: int, port: int, timeout: float, results, join: bool) -> None:
    try:
        if join:
            results.put((rank, "ok", fn(create_sync_group("127.0.0.1", port, world, rank, timeout=timeout), rank)))
        else:
            results.put((rank, "ok", fn(port, rank)))
    except BaseException as e:
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_group(
    fns: list[Callable],
    *,
    timeout: float = 20.0,
    deadline: float = 120.0,
    kill: dict[int, Callable[[], bool]] | None = None,
    join: bool = True,
) -> dict[int, tuple[str, object]]:
    """Start `fns[r](group, r)` as rank r of one group (use functools.partial for more arguments), or with
    `join=False` `fns[r](port, r)` for processes that join the group on `port` themselves;
    `kill={rank: condition}` SIGKILLs that rank as soon as `condition()` (checked here) is true.

    Returns {rank: ("ok", value) | ("error", text) | ("killed", None) | ("died", exit code)}: "died" for a process
    that ended without a word (it killed itself, or crashed), as soon as its last words had a second to arrive. Any
    process still running after `deadline` seconds is killed and reported as "hung", so a test never hangs.
    """
    results = CONTEXT.Queue()
    port = free_port()
    procs = [
        CONTEXT.Process(target=_child, args=(fn, r, len(fns), port, timeout, results, join)) for r, fn in enumerate(fns)
    ]
    for p in procs:
        p.start()
    started = time.monotonic()
    killed = set()
    outcome: dict[int, tuple[str, object]] = {}
    ended: dict[int, float] = {}  # when a process was first seen ended without a result
    while len(outcome) + len(killed) < len(procs) and time.monotonic() - started < deadline:
        for rank, condition in (kill or {}).items():
            if rank not in killed and condition():
                os.kill(procs[rank].pid, signal.SIGKILL)
                killed.add(rank)
        try:
            rank, status, value = results.get(timeout=0.1)
            outcome[rank] = (status, value)
        except queue.Empty:
            pass
        now = time.monotonic()
        for rank, p in enumerate(procs):
            gone = rank not in outcome and rank not in killed and p.exitcode is not None
            if gone and now - ended.setdefault(rank, now) > 1.0:
                outcome[rank] = ("died", p.exitcode)
    for rank, p in enumerate(procs):
        if rank in killed:
            outcome.setdefault(rank, ("killed", None))
        elif rank not in outcome:
            outcome[rank] = ("hung", None)
        p.join(timeout=1)
        if p.is_alive():
            p.kill()
            p.join()
    return outcome

"""Stopping a run: Ctrl-C (SIGINT) or SIGTERM (what job schedulers send first) — the step in progress finishes, a
checkpoint of it is written, the engine shuts down, and the command to resume is printed (the resumed run repeats the
uninterrupted one). Another signal, a moment later, quits at once.

A signal sent to the process group reaches the trainer twice under `uv run` (from the group, and forwarded by uv), and
a scheduler may repeat it: copies within `REPEAT_S` of the first count as that one."""

import signal
import threading
import time
from collections.abc import Callable

REPEAT_S = 1.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """While entered (in the main thread), SIGINT and SIGTERM set `requested` instead of ending the process; the next
    one, more than `REPEAT_S` later, raises KeyboardInterrupt."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.requested, self.signal_name = say, False, None
        self._first_at: float | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._interrupt) for signum in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _interrupt(self, signum, frame) -> None:
        now = time.monotonic()
        if self.requested:
            if now - self._first_at > REPEAT_S:
                raise KeyboardInterrupt
            return
        self.requested, self._first_at, self.signal_name = True, now, signal.Signals(signum).name
        what = "Ctrl-C" if signum == signal.SIGINT else self.signal_name
        self.say(f"{what}: stopping after this step, with a checkpoint (Ctrl-C again to quit now)")


def ignore_stop_signals() -> None:
    """In a helper process (engine, reward scorer): SIGINT and SIGTERM sent to the whole process group are left to
    the trainer, which finishes its step, checkpoints, and then ends its helpers."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)

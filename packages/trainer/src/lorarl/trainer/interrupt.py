"""Ctrl-C during a run: the step in progress finishes, a checkpoint of it is written, the engine shuts down, and the
command to resume is printed (the resumed run repeats the uninterrupted one). A second Ctrl-C quits at once."""

import signal
import threading
from collections.abc import Callable


class StopRequest:
    """While entered (in the main thread), SIGINT sets `requested` instead of raising — once: the second raises
    KeyboardInterrupt as usual."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.requested, self._previous = say, False, None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _interrupt(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.say("Ctrl-C: stopping after this step, with a checkpoint (Ctrl-C again to quit now)")
